"""One packed model step: its metadata (which tokens belong to which sequence, where they go in
the paged KV cache, the step's LoRA rows and prompt tables), the KV cache's layout and dtypes,
and the attention backends that read and write it. Below the models and the runtime: the
runtime builds steps to serve requests, calibration builds them to measure a model."""
