"""Real servers and programs the tests run on loopback: kvgate gateways (loopback), Redis, DNS, headless Chromium."""
