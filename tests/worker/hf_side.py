"""The Hugging Face side of the export tests, run in a process of its own (`run_hf`): torch and JAX each
load an LLVM, and the two cannot share a process.

`python hf_side.py REQUEST.json RESULT_DIR`; the request names the exported model's directory (`model`) and
what to compute with transformers (offline: nothing is downloaded; with `gguf_file`, a GGUF file's name in
that directory, all of it from that file, as transformers converts GGUF):
- `config`: the config as transformers reads it (`rope_parameters`, `layer_types`, ...);
- `tokens` (an `.npy` of token ids, batch x length): `logits.npy` of `Gemma3ForCausalLM` from the directory
  (with `adapter`, a PEFT adapter's directory: of that model with the adapter, `peft.PeftModel`);
- `texts`: each text's ids by `AutoTokenizer` (with its bos), and `chats`: each conversation's ids through
  the tokenizer's chat template (`apply_chat_template`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def main(request_path: str, result_dir: str) -> None:
    request = json.loads(Path(request_path).read_text())
    result: dict[str, Any] = {}
    model_dir = request["model"]
    gguf = {"gguf_file": request["gguf_file"]} if request.get("gguf_file") else {}
    if request.get("config"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, **gguf)
        result["config"] = json.loads(config.to_json_string(use_diff=False))
    if request.get("tokens"):
        import numpy as np
        import torch
        from transformers import Gemma3ForCausalLM

        model = Gemma3ForCausalLM.from_pretrained(model_dir, **gguf)
        if request.get("adapter"):
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, request["adapter"])
        model.eval()
        result["dtype"] = str(model.dtype)
        with torch.no_grad():
            logits = model(torch.tensor(np.load(request["tokens"]))).logits
        np.save(Path(result_dir) / "logits.npy", logits.float().numpy())
    if request.get("texts") or request.get("chats"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, **gguf)
        result["texts"] = [tokenizer(text)["input_ids"] for text in request.get("texts", [])]
        result["chats"] = [
            list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
            for chat in request.get("chats", [])
        ]
    (Path(result_dir) / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
