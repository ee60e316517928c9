"""Tools over the engine's rules: the capacity planner (`kvgate plan`) and the int4 quantizer
(`kvgate quantize`).

May import any layer but process; nothing in the engine imports them. The planner reads only the
torch-free rules (config, the tensor-parallel split rules), so it runs without loading the engine.
"""
