"""The served models: each model's pool of deployments (`registry`), admission by SLA class
and load (`admission`), circuit breakers (`breaker`) and deployments found in DNS (`discovery`).

May import the seam only.
"""
