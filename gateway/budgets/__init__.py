"""Budgets: cumulative spend per key and team (tokens or money, per calendar or rolling window),
reserved at admission and settled to the usage reported, in memory or in the shared Redis."""
