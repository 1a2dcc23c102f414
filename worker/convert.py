"""`python -m worker.convert FINAL_URI [--hf] [--gguf TYPE]`: a finished job's weights in the formats
`method.export_hf` and `method.export_gguf` ask for, for a job that ran without them (or to export again):
from its `{output_uri}/final` (its `export.json` says the model, method, dtype, base weights and tokenizer)
into `final/hf` (a LoRA job's adapter also into `final/hf_adapter`) and `final/model-{TYPE}.gguf`, as the
job would have written them (`--hf` when neither is given). In one process, on any machine with the
worker's environment and access to those paths (the worker image: `docker run ... python -m worker.convert
gs://.../final`). A LoRA job exported without its merged weights is merged here: its base weights are read
again (the official ones unless it named others), and the adapter folded in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from etils import epath
from gemma import gm

from worker import model as gemma
from worker.config import GGUF_TYPES, JobSpec, Method
from worker.exports import export_formats


def convert(
    final: str, *, hf: bool = True, gguf: str | None = None, cache_dir: Path | None = None
) -> dict[str, str]:
    """Write the export under `final` as a Hugging Face model (with `hf`; and a LoRA job's PEFT adapter)
    and as a GGUF file of type `gguf`; returns {"hf": ..., "hf_adapter": ..., "gguf": ...} as written,
    also added to its `export.json`."""
    from worker.train import RunOptions, load_tokenizer, make_mesh, tree_shardings

    path = epath.Path(final) / "export.json"
    if not path.is_file():
        raise gemma.ModelError("export_not_found", f"{final} holds no export.json: not a job's final export")
    export = json.loads(path.read_text())
    method = Method.model_validate(export["method"])
    dtype = jnp.dtype(export["dtype"])
    spec = JobSpec.model_construct(
        model=export["model"],
        base_checkpoint_uri=export.get("base_checkpoint_uri"),
        adapter_uri=export.get("adapter_uri"),
        tokenizer_uri=export.get("tokenizer_uri"),
    )
    tokenizer = load_tokenizer(spec, RunOptions(cache_dir=cache_dir))
    model = gemma.build_model(
        spec.model, tokenizer.vocab_size, lora_rank=None, param_dtype=dtype, compute_dtype=dtype
    )
    cast = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree))
    adapter = gm.ckpts.load_params(export["adapter"]) if method.type == "lora" else None
    if "params" in export:
        weights = cast(gm.ckpts.load_params(export["params"]))
    else:  # (a LoRA job's adapter alone: on its base, read again)
        shardings = tree_shardings(make_mesh(1), model.abstract_params()[0])
        base = gemma.load_base_params(spec, model, shardings, cache_dir)
        weights = cast(jax.jit(gemma.merge_lora)(base, adapter))
    # (the adapter on its own goes only to the Hugging Face export, for PEFT)
    adapter = cast(adapter) if adapter is not None and hf else None
    written = export_formats(
        weights,
        adapter,
        final,
        spec=spec,
        config=model.base.config,
        tokenizer=tokenizer,
        hf=hf,
        gguf=gguf,
        name=export.get("job_id"),
    )
    path.write_text(json.dumps({**export, **written}, indent=2) + "\n")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.convert", description=__doc__.splitlines()[0])
    parser.add_argument("final", help="a job's final export: {output_uri}/final")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache for downloaded and converted files"
    )
    parser.add_argument("--hf", action="store_true", help="a Hugging Face model (the default without --gguf)")
    parser.add_argument(
        "--gguf", choices=GGUF_TYPES, default=None, help="a GGUF file, its matrices in this type"
    )
    args = parser.parse_args(argv)
    try:
        written = convert(
            args.final, hf=args.hf or args.gguf is None, gguf=args.gguf, cache_dir=args.cache_dir
        )
    except gemma.ModelError as error:
        print(f"{error.code}: {error.message}", file=sys.stderr)
        return 2
    for kind, uri in written.items():
        print(f"{kind}: {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
