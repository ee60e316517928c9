"""What changes the serving state while it serves: a config reload (`reload`, on SIGHUP or
POST /admin/reload) and the keys file watched for changes (`keys_file`).

May import the seam, pools/, keys/ and gateway.state.
"""
