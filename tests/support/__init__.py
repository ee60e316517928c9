"""What the tests share, by kind (imported as tests.support.<kind>.<module>):

- servers: real servers and programs run on loopback: kvgate gateways and scripted raw servers
  (loopback), Redis, DNS, headless Chromium;
- fakes: stand-ins for what cannot run here or must misbehave on cue: a scripted OpenAI-compatible
  upstream, the tensorrt_llm stand-in;
- checks: what several tests check (engines, streams, tensor parallelism, perplexity, translated
  streams, the fuzz driver) and the pytest plugins that keep a skip from hiding a failure (skips,
  c_kernels);
- data: inputs built from rules or saved models: paged-attention cases, tiny Llama checkpoints,
  the AutoAWQ packing rules.
"""
