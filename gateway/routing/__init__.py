"""Which deployment takes a request: the built-in policies (`policies`: round robin, least
loaded, power of two, prefix affinity...), precise prefix routing on the engines' KV events
(`precise_prefix`), LoRA adapters' slots (`lora_affinity`), a prompt's size and token ids for
routing (`prompt_tokens`), and the plugin that registers them (`builtin`, the `kvgate` entry point `builtin_policies`).

May import the seam, kv_index/ and pools/.
"""
