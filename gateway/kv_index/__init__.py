"""The engines' KV-cache events (`events`: subscriptions, replay, the wire format) and the
index of which engine holds which prefix block (`index`), read by precise prefix routing.

May import the seam only.
"""
