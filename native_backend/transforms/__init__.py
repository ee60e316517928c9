"""Transforms applied to a plain, loaded model: they swap modules, never branch inside the model."""
