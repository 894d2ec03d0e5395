"""The configuration floor: the run configuration as pure data, below ``stepgraph`` and ``trainer``.

``train`` (``TrainConfig`` and its sections, YAML loading, ``--set`` overrides), ``model``
(``Qwen3_5Config``: the decoder's fields, parameter counts), ``layout`` (``Layout``: the parallel
degrees, their rules and derived dimensions, rank coordinates, the pipeline's layer split; the
trainer's ``ParallelDims`` adds the device meshes), ``cp`` (per-layer context-parallel modes and
their rules), ``cp_modes`` (the context-parallel mode registry: one entry per mode), ``hf``
(Hugging Face ``config.json`` <-> ``Qwen3_5Config``), ``run`` (checkpoint, metrics and
profiling sections), ``data_sources`` / ``byte_tokenizer`` (data files and tokenizers the
``data`` section names), ``yaml_io`` (strict YAML).

May import: ``ops.gdn.options`` (the GDN kernel options' rules), ``schedules`` (schedule kinds
and specs, pure), ``layers.rope`` (the rotary rule; ``layers`` imports torch and ``ops`` only), pydantic, yaml, torch (the byte tokenizer's tensors), the standard library;
optional packages (``tokenizers``, ``datasets``) only inside the function that needs them. No
``torch.distributed`` and nothing that imports it: ``stepgraph`` plans any scale from this
package without a process group.
"""
