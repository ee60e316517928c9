"""The gateway's instruments: Prometheus metrics (`metrics`), OpenTelemetry tracing (`tracing`)
and the status page's recent latencies and errors (`recent`). What one request writes to them is
dispatch/recorder.py.

May import the seam, pools/ and keys/ (the live gauges read them).
"""
