"""One request's way to a backend and back: choices opened on deployments with admission,
failover and breaker verdicts (`choices`), the prefill/decode hops of a disaggregated pool
(`disagg`), and the recorder that closes the request's books (metrics, spans, key limits, observer
hooks) in `recorder`.

May import the seam, protocol/, pools/, routing/, observability/ and gateway.state.
"""
