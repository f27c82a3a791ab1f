"""The engines, each behind the decoding loop's one seam
(`fsd_chat.decoding.runner.ModelRunner`).

- `llama_cpp`: GGUF files run natively quantized on llama.cpp through llama-cpp-python, an
  optional dependency imported only when the engine is used.
- `torch_engine`: transformers models in torch: the decoders over them (`binding`) and their
  forward times (`timings`). Its runners are `fsd_chat.decoding.kv_cache`'s (its static and compiled caches and the whole-step
  CUDA graphs of `fsd_chat.decoding.step_graph` are its own).
"""
