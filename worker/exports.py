"""The formats a job's final weights are exported in besides orbax, as its spec asks (`method.export_hf`,
`method.export_gguf`): written by the trainer at the end of a run, and by `python -m worker.convert`
afterwards, alike."""

from __future__ import annotations

from typing import Any

from worker.checkpoint import join
from worker.config import JobSpec, gguf_file_name
from worker.gguf_export import export_gguf
from worker.hf import export_hf, export_hf_adapter, peft_base
from worker.tokenizer import Tokenizer

Params = dict[str, Any]


def export_formats(
    weights: Params,
    adapter: Params | None,
    final: str,
    *,
    spec: JobSpec,
    config: Any,
    tokenizer: Tokenizer,
    hf: bool,
    gguf: str | None,
    name: str | None = None,
) -> dict[str, str]:
    """Under `final` (a job's `{output_uri}/final`): with `hf`, `hf`, the whole network's `weights` as a
    Hugging Face model, and with a LoRA `adapter`, `hf_adapter` for PEFT; with `gguf` (a type), `gguf`,
    the weights as a GGUF file named `name` inside. Every JAX process calls it. Returns their URIs by name."""
    written: dict[str, str] = {}
    if hf:
        written["hf"] = join(final, "hf")
        export_hf(weights, written["hf"], config=config, model_name=spec.model, tokenizer=tokenizer)
        if adapter is not None:
            written["hf_adapter"] = join(final, "hf_adapter")
            base = peft_base(spec.model, spec.base_checkpoint_uri, spec.adapter_uri)
            export_hf_adapter(adapter, written["hf_adapter"], config=config, base_model=base)
    if gguf is not None:
        written["gguf"] = join(final, gguf_file_name(gguf))
        export_gguf(
            weights,
            written["gguf"],
            config=config,
            model_name=spec.model,
            tokenizer=tokenizer,
            outtype=gguf,
            name=name,
        )
    return written
