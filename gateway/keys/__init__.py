"""Who may call and how much: API keys (`store`), per-key limits in this process (`limits`) or
in Redis shared by replicas (`redis_limiter`), and status-page sessions (`sessions`).

May import the seam only.
"""
