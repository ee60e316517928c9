"""What several tests check, and the pytest plugins that keep a skip from hiding a failure (skips, c_kernels)."""
