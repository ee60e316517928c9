"""Test inputs built from rules or saved models: paged-attention cases, tiny Llama checkpoints, the AutoAWQ packing rules."""
