"""`tputune`: the command line. Every command but `serve`/`migrate` is a client of the REST API."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from api.client import FINAL_STATUSES, ApiError, Client

EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 2}


# --- server side ---


def serve(args: argparse.Namespace) -> int:
    from api.server import run

    pairs = (("host", args.host), ("port", args.port), ("workers", args.workers))
    return run({name: value for name, value in pairs if value is not None})


def migrate(args: argparse.Namespace) -> int:
    from api.migrate import downgrade, upgrade
    from api.settings import Settings

    url = Settings().resolved_database_url
    if args.down:
        downgrade(url, args.revision)
    else:
        upgrade(url, args.revision)
    return 0


def demo(args: argparse.Namespace) -> int:
    from api.demo import run_demo

    return run_demo(args)


def check_data(args: argparse.Namespace) -> int:
    """What a dataset holds and packs into, read and tokenized as a job would (needs the worker extra)."""
    try:
        from pydantic import ValidationError

        from worker.config import Hyperparameters
        from worker.data import DataError, Preference, check_objective, read_documents, summarize
        from worker.gguf_import import gguf_tokenizer_model
        from worker.tokenizer import OFFICIAL_TOKENIZER_URI, Tokenizer
    except ImportError as error:
        print(f"tputune check-data needs the worker's packages (the worker extra): {error}", file=sys.stderr)
        return 2
    try:
        Hyperparameters(max_seq_len=args.max_seq_len)  # (the bounds a job's spec has)
    except ValidationError as error:
        print(f"error: --max-seq-len: {error.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        documents = read_documents(args.dataset)
        dpo = any(isinstance(document, Preference) for document in documents)
        check_objective(documents, args.dataset, "dpo" if dpo else "sft")
    except DataError as error:
        print(f"error: {error.message} ({error.code})", file=sys.stderr)
        return 3
    source = args.tokenizer or OFFICIAL_TOKENIZER_URI
    try:
        tokenizer = Tokenizer.load(gguf_tokenizer_model(source) if source.endswith(".gguf") else source)
    except Exception as error:  # (a missing file, not a SentencePiece model, storage that does not answer)
        print(f"error: cannot read the tokenizer {source}: {error} (bad_tokenizer)", file=sys.stderr)
        return 3
    if dpo and args.train_on_inputs:
        print("error: --train-on-inputs: preference pairs train on their replies alone", file=sys.stderr)
        return 2
    try:
        summary = summarize(documents, tokenizer, args.max_seq_len, args.train_on_inputs)
    except DataError as error:
        print(f"error: {error.message} ({error.code})", file=sys.stderr)
        return 3
    stats, lengths = summary.stats, sorted(summary.lengths)
    kinds = [
        (summary.texts, "text"),
        (summary.chats, "chat"),
        (summary.completions, "prompt/completion pair"),
        (summary.preferences, "preference pair"),
    ]
    said = ", ".join(f"{n:,} {what}{'s' if n != 1 else ''}" for n, what in kinds if n)
    # (a preference pair: both replies with their prompt; its replies' tokens are the ones compared)
    unit, trained, pieces = (
        ("pair", "scored", "its replies cut short") if dpo else ("document", "trained", "packed in pieces")
    )
    print(f"{args.dataset}: {stats.documents:,} {'records' if dpo else 'documents'} ({said})")
    share = stats.target_tokens / stats.tokens if stats.tokens else 0.0
    print(
        f"  tokens: {stats.tokens:,}, {trained} {stats.target_tokens:,} ({share:.1%}); per {unit} median "
        f"{lengths[len(lengths) // 2]:,}, longest {lengths[-1]:,}"
    )
    cut = summary.cut
    longer = f"; {cut:,} {unit}{'s' if cut != 1 else ''} longer than a row, {pieces}" if cut else ""
    print(f"  max_seq_len {args.max_seq_len}: {stats.rows:,} rows, {stats.pad_fraction:.1%} padding{longer}")
    return 0


# --- client side ---


def _client(args: argparse.Namespace) -> Client:
    return Client(base_url=args.api_url, api_key=args.api_key)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def _accuracies(metrics: dict[str, Any]) -> str:
    """The token accuracies there are, as " acc 41.2% eval-acc 38.0%" (none from a worker that sends none)."""
    named = (("acc", metrics.get("accuracy")), ("eval-acc", metrics.get("eval_accuracy")))
    return "".join(f" {name} {_percent(value)}" for name, value in named if value is not None)


def _rewards(metrics: dict[str, Any]) -> list[tuple[str, float, float]]:
    """A dpo job's rewards there are, (prefix, chosen, rejected): training ("") and held out ("eval_")."""
    pairs = (
        (prefix, metrics.get(f"{prefix}chosen_reward"), metrics.get(f"{prefix}rejected_reward"))
        for prefix in ("", "eval_")
    )
    return [
        (prefix, chosen, rejected)
        for prefix, chosen, rejected in pairs
        if chosen is not None and rejected is not None
    ]


def _margins(metrics: dict[str, Any]) -> str:
    """A dpo job's reward margins (the chosen replies' reward less the rejected's), as " margin +0.4300
    eval-margin +0.3500"; "" for other jobs."""
    return "".join(f" {prefix.replace('_', '-')}margin {c - r:+.4f}" for prefix, c, r in _rewards(metrics))


def rewards_line(job: dict[str, Any]) -> str | None:
    """A dpo job's latest rewards, once its worker reported them: "rewards: chosen +0.1200 rejected -0.3100
    (margin +0.4300); held out: chosen ... (margin ...)"."""
    said = [
        f"{'held out' if prefix else 'rewards'}: chosen {c:+.4f} rejected {r:+.4f} (margin {c - r:+.4f})"
        for prefix, c, r in _rewards(job["metrics"])
    ]
    return "; ".join(said) or None


def progress_line(job: dict[str, Any], width: int = 24) -> str:
    """One line: bar, step, loss, eval loss, token accuracies, tokens/s, eta, status."""
    progress, metrics = job["progress"], job["metrics"]
    fraction = progress["fraction"] or 0.0
    filled = round(fraction * width)
    bar = "#" * filled + "." * (width - filled)
    total = progress["total_steps"] or "?"
    tps = metrics["tokens_per_second"]
    return (
        f"[{bar}] {fraction * 100:5.1f}% step {progress['step']}/{total} "
        f"loss {_num(metrics['loss'])} eval {_num(metrics['eval_loss'])}{_accuracies(metrics)} "
        f"{_num(tps, ',.0f')} tok/s eta {_duration(progress['eta_seconds'])} {job['status']}"
    )


def watch_line(job: dict[str, Any]) -> str:
    """What `watch` shows: until the job runs, and while it is paused, its status and why; then
    `progress_line`."""
    if job["status"] in ("queued", "starting", "pausing", "paused") and job.get("status_message"):
        return f"{job['status']}{queue_place(job)}: {job['status_message']}"
    return progress_line(job)


def queue_place(job: dict[str, Any]) -> str:
    """For a queued job whose place the API gave (GET /jobs/{id}): ` (3rd in the queue)`; else nothing."""
    position = job.get("queue_position")
    if not position:
        return ""
    suffix = "th" if 10 <= position % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(position % 10, "th")
    return f" ({position}{suffix} in the queue)"


def is_dpo(job: dict[str, Any]) -> bool:
    """Whether a job learns from preference pairs (`method.objective` dpo)."""
    return bool((job.get("spec") or {}).get("method", {}).get("objective") == "dpo")


def method_name(job: dict[str, Any]) -> str:
    """How a job trains, as "lora", "full, dpo" or "lora, simpo" (a dpo job with `simpo_gamma`)."""
    if not is_dpo(job):
        return str(job["method"])
    return f"{job['method']}, {'simpo' if job['spec']['method'].get('simpo_gamma') else 'dpo'}"


def _print_job(job: dict[str, Any]) -> None:
    method = method_name(job)
    print(f"{job['id']}  {job['name']}  {job['model']} ({method})  {job['status']}{queue_place(job)}")
    if job.get("status_message"):
        print(f"  {job['status_message']}")
    print(f"  {progress_line(job)}")
    if line := rewards_line(job):
        print(f"  {line}")
    if job.get("error"):
        print(f"  error: {job['error']['message']} ({job['error']['code']})")
    if job["status"] == "failed":
        since = "its last checkpoint" if job.get("checkpoint_uri") else "the start"
        print(f"  to go on from {since}: tputune resume {job['id']}")
    if line := interruptions_line(job):
        print(f"  {line}")
    if line := usage_line(job):
        print(f"  {line}")
    if line := data_line(job):
        print(f"  {line}")
    print(f"  output: {job['output_uri']}{exported_note(job)}")
    if line := hf_line(job):
        print(f"  {line}")
    if line := gguf_line(job):
        print(f"  {line}")
    if job.get("checkpoint_uri"):
        print(f"  latest checkpoint: {job['checkpoint_uri']}")


def exported_note(job: dict[str, Any]) -> str:
    """Of a job that exported the weights of an earlier step than its last (export_best): which; else ""."""
    exported = job.get("exported_step")
    if exported is None or exported == job["progress"]["step"]:
        return ""
    return f" (the weights of step {exported}, of the lowest eval loss)"


def hf_line(job: dict[str, Any]) -> str | None:
    """Where a job that succeeded with `export_hf` put its Hugging Face model (and a LoRA job's adapter)."""
    exports = job.get("exports") or {}
    if not exports.get("hf"):
        return None
    adapter = f" (adapter for PEFT: {exports['hf_adapter']})" if exports.get("hf_adapter") else ""
    return f"Hugging Face model: {exports['hf']}{adapter}"


def gguf_line(job: dict[str, Any]) -> str | None:
    """Where a job that succeeded with `export_gguf` put its GGUF file."""
    exports = job.get("exports") or {}
    return f"GGUF (llama.cpp, ollama): {exports['gguf']}" if exports.get("gguf") else None


def interruptions_line(job: dict[str, Any]) -> str | None:
    """How often the job's run was interrupted and resumed, if ever: "2 restarts, 1 pause (...)"."""
    names = {"restarts": "restart", "preemptions": "preemption", "pauses": "pause", "retries": "retry"}
    said = [f"{n} {name if n > 1 else one}" for name, one in names.items() if (n := job.get(name) or 0)]
    return f"{', '.join(said)} (each resumed from the latest checkpoint)" if said else None


def usage_line(job: dict[str, Any]) -> str | None:
    """What the job has held, once it took its chips: "held 8 TPU chips for 1h02m: 8.267 chip-hours"."""
    usage = job.get("usage") or {}
    if not usage.get("held_seconds"):
        return None
    chips, unit = usage["chips"], usage["chip_unit"]
    what = {"processes": "process", "TPU chips": "TPU chip"}.get(unit, unit) if chips == 1 else unit
    return (
        f"held {chips} {what} for {_duration(usage['held_seconds'])}: {usage['chip_hours']:,.4g} chip-hours"
    )


def data_line(job: dict[str, Any]) -> str | None:
    """What its data came to, once the worker packed it: "data: 380 documents, 51,234 tokens in 790 rows
    of 64 (0.2% padding), 98 steps an epoch; validation 20 documents"."""
    data = job.get("data_stats")
    if not data:
        return None
    documents = "preference pairs" if data.get("preference_pairs") else "documents"
    line = (
        f"data: {data['documents']:,} {documents}, {data['tokens']:,} tokens in {data['rows']:,} rows of "
        f"{data['row_tokens']} ({data['pad_fraction']:.1%} padding), "
        f"{data['steps_per_epoch']:,} steps an epoch"
    )
    if data.get("validation_documents") is not None:
        line += f"; validation {data['validation_documents']:,} {documents}"
    return line


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if args.spec:
        text = Path(args.spec).read_text()
        if args.spec.endswith((".yaml", ".yml")):
            import yaml

            spec = yaml.safe_load(text) or {}
        else:
            spec = json.loads(text)
    given = {"name": args.name, "model": args.model, "dataset_uri": args.dataset, "from_job": args.from_job}
    given["from_step"] = args.from_step
    for key, value in given.items():
        if value is not None:
            spec[key] = value
    if args.method:
        spec.setdefault("method", {})["type"] = args.method
    if args.lora_rank:
        spec.setdefault("method", {})["lora_rank"] = args.lora_rank
    if args.objective:
        spec.setdefault("method", {})["objective"] = args.objective
    if args.dpo_beta is not None:
        spec.setdefault("method", {})["dpo_beta"] = args.dpo_beta
    if args.export_hf:
        spec.setdefault("method", {})["export_hf"] = True
    if args.export_gguf:
        spec.setdefault("method", {})["export_gguf"] = args.export_gguf
    hp = {
        "epochs": args.epochs,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "max_seq_len": args.max_seq_len,
    }
    for key, value in hp.items():
        if value is not None:
            spec.setdefault("hyperparameters", {})[key] = value
    if args.processes:
        spec.setdefault("resources", {})["processes"] = args.processes
    for assignment in args.set or []:
        path, _, value = assignment.partition("=")
        node = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _parse_value(value)
    return spec


def submit(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.create_job(build_spec(args), idempotency_key=args.idempotency_key)
        print(f"submitted {job['id']} ({job['status']})")
        if args.follow:
            return _watch(client, job["id"], args.interval)
    return 0


def list_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_jobs(status=args.status, limit=args.limit, after=args.after, tenant=args.tenant)
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    if args.quiet:
        for job in page["data"]:
            print(job["id"])
        return 0
    # A tenant column when the page holds more than one tenant's jobs (the admin key sees them all).
    tenants = len({job["tenant"] for job in page["data"]}) > 1
    head = f"{'TENANT':<16} " if tenants else ""
    print(f"{'ID':<16} {head}{'STATUS':<10} {'MODEL':<16} {'METHOD':<6} {'PROGRESS':>8} {'LOSS':>8}  NAME")
    for job in page["data"]:
        fraction = job["progress"]["fraction"]
        done = f"{fraction * 100:.0f}%" if fraction is not None else "-"
        loss = _num(job["metrics"]["loss"])
        tenant = f"{job['tenant']:<16} " if tenants else ""
        print(
            f"{job['id']:<16} {tenant}{job['status']:<10} {job['model']:<16} {job['method']:<6} {done:>8} "
            f"{loss:>8}  {job['name']}"
        )
    if page["has_more"]:
        print(f"(more: --after {page['next_after']})")
    return 0


def status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.get_job(args.job_id)
    if args.json:
        print(json.dumps(job, indent=2))
    else:
        _print_job(job)
    return 0


def _watch(client: Client, job_id: str, interval: float) -> int:
    tty = sys.stdout.isatty()
    last = ""
    while True:
        job = client.get_job(job_id)
        line = watch_line(job)
        if line != last:
            print(("\r\x1b[2K" if tty else "") + line, end="" if tty else "\n", flush=True)
            last = line
        if job["status"] in FINAL_STATUSES:
            if tty:
                print()
            if job.get("error"):
                print(f"error: {job['error']['message']} ({job['error']['code']})")
            print(f"{job_id} {job['status']}")
            return EXIT_CODES[job["status"]]
        time.sleep(interval)


def watch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _watch(client, args.job_id, args.interval)


def _print_event(event: dict[str, Any]) -> None:
    print(f"{event['created_at'][:19]}  {event['level']:<5} {event['type']:<10} {event['message']}")


def events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.follow:
            for event in client.follow_events(args.job_id, after=args.after):
                _print_event(event)
            return 0
        page = client.events(args.job_id, after=args.after, limit=args.limit)
    for event in page["data"]:
        _print_event(event)
    return 0


def logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        answer = client.logs(args.job_id, tail=args.tail, previous=args.previous, run=args.run)
        seen = answer["lines"]
        if answer.get("saved_at"):
            run = f"run {answer['run']}" if answer.get("run") is not None else "the run"
            print(f"(saved as {run} ended, {answer['saved_at']}: its pods are gone)", file=sys.stderr)
        for line in seen:
            print(line)
        while args.follow:
            # Poll the tail and print what is new after the last line we printed.
            time.sleep(1.0)
            answer = client.logs(args.job_id, tail=1000)
            final = client.get_job(args.job_id)["status"] in FINAL_STATUSES
            if answer.get("saved_at") and not final:
                continue  # (between pods: the lines saved as an earlier run ended, printed before if at all)
            lines = answer["lines"]
            start = _overlap(seen, lines)
            for line in lines[start:]:
                print(line, flush=True)
            seen = lines
            if final and start == len(lines):
                break
    return 0


def _overlap(before: list[str], after: list[str]) -> int:
    """Index in `after` where lines not in `before` start (the longest suffix/prefix match)."""
    for size in range(min(len(before), len(after)), 0, -1):
        if before[-size:] == after[:size]:
            return size
    return 0


def act(args: argparse.Namespace) -> int:
    """cancel, pause or resume (`args.action`) a job; print its status after."""
    with _client(args) as client:
        job = getattr(client, f"{args.action}_job")(args.job_id)
    print(f"{job['id']} {job['status']}")
    return 0


def delete(args: argparse.Namespace) -> int:
    """Delete each job of `args.job_ids` that ended; say of each what became of it. Exit 3 if any was not
    deleted (the others are)."""
    failed = False
    with _client(args) as client:
        for job_id in args.job_ids:
            try:
                deleted = client.delete_job(job_id)
            except ApiError as exc:
                print(f"error: {job_id}: {exc.message} ({exc.code})", file=sys.stderr)
                failed = True
                continue
            print(f"{deleted['id']} deleted (its outputs stay at {deleted['output_uri']})")
    return 3 if failed else 0


METRIC_COLUMNS = (
    *("step", "loss", "accuracy", "eval_loss", "eval_accuracy", "learning_rate", "grad_norm"),
    *("tokens_per_second", "trained_tokens", "epoch"),
    *("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward"),
)


def metrics(args: argparse.Namespace) -> int:
    """The job's metrics per step: a table, or CSV (every column, as the API gives them) to plot."""
    with _client(args) as client:
        points = list(client.metric_points(args.job_id, args.min_step, args.max_step))
    if args.every > 1 and points:
        # Every N-th step, each eval's, and the last: the curve's shape without a line a step.
        last = points[-1]["step"]

        def kept(point: dict[str, Any]) -> bool:
            return point["step"] % args.every == 0 or point["step"] == last or point["eval_loss"] is not None

        points = [point for point in points if kept(point)]
    if args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(METRIC_COLUMNS)
        writer.writerows([["" if p.get(c) is None else p[c] for c in METRIC_COLUMNS] for p in points])
        return 0
    if not points:
        print("no metrics yet")
        return 0
    # A dpo job's rewards (the step's, chosen and rejected), where its worker reported them.
    rewards = any(p.get("chosen_reward") is not None for p in points)
    header = f"{'STEP':>8} {'LOSS':>9} {'ACC':>7} {'EVAL LOSS':>10} {'EVAL ACC':>9} {'LR':>10} {'TOK/S':>9}"
    print(header + (f" {'CHOSEN':>8} {'REJECTED':>8}" if rewards else ""))
    for p in points:
        line = (
            f"{p['step']:>8} {_num(p['loss']):>9} {_percent(p.get('accuracy')):>7} "
            f"{_num(p['eval_loss']):>10} {_percent(p.get('eval_accuracy')):>9} "
            f"{_num(p['learning_rate'], '.3e'):>10} {_num(p['tokens_per_second'], ',.0f'):>9}"
        )
        if rewards:
            line += f" {_num(p.get('chosen_reward'), '+.4f'):>8} {_num(p.get('rejected_reward'), '+.4f'):>8}"
        print(line)
    return 0


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def checkpoints(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.checkpoints(args.job_id)["data"]
    if not data:
        print("no checkpoints yet")
    for ckpt in data:
        metrics = ckpt["metrics"]
        removed = "  (removed)" if ckpt.get("kept") is False else ""
        print(
            f"step {ckpt['step']:>7}  loss {_num(metrics['loss'])}  eval {_num(metrics['eval_loss'])}"
            f"{_accuracies(metrics)}{_margins(metrics)}  {ckpt['uri']}{removed}"
        )
    return 0


def _time(stamp: str) -> datetime:
    """An API time (ISO 8601) in UTC."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(UTC)


def _when(stamp: str) -> str:
    """An API time to the minute, as `2026-12-05 06:32`."""
    return _time(stamp).strftime("%Y-%m-%d %H:%M")


def keys(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "create":
            key = client.create_key(args.tenant, args.name, args.expires_in_days, args.admin, args.read_only)
            expiry = f", expires {_when(key['expires_at'])}" if key["expires_at"] else ""
            role = {"admin": "an admin key ", "auditor": "an auditor key ", "reader": "a read-only key "}.get(
                key["role"], ""
            )
            print(f"created {role}{key['id']} for tenant {key['tenant']}{expiry}; the key is shown only now:")
            print(key["key"])
        elif args.action == "list":
            print(
                f"{'ID':<16} {'PREFIX':<16} {'TENANT':<16} {'ROLE':<7} {'STATE':<28} {'LAST USED':<18} NAME"
            )
            now = datetime.now(UTC)
            for key in client.list_keys(args.tenant)["data"]:
                if key["revoked_at"]:
                    state = f"revoked {_when(key['revoked_at'])}"
                elif key["expires_at"] and _time(key["expires_at"]) <= now:
                    state = f"expired {_when(key['expires_at'])}"
                elif key["expires_at"]:
                    state = f"expires {_when(key['expires_at'])}"
                else:
                    state = "active"
                used = _when(key["last_used_at"]) if key["last_used_at"] else "never"
                role = key["role"]
                print(
                    f"{key['id']:<16} {key['prefix']:<16} {key['tenant']:<16} {role:<7} {state:<28} "
                    f"{used:<18} {key['name']}"
                )
        elif args.action == "rotate":
            key = client.rotate_key(args.key_id, args.grace_seconds, args.expires_in_days)
            old = key["replaces"]
            expiry = f", expires {_when(key['expires_at'])}" if key["expires_at"] else ""
            print(
                f"created {key['id']} for tenant {key['tenant']}{expiry}; {old['id']} stops working at "
                f"{_time(old['expires_at']).strftime('%Y-%m-%d %H:%M:%S')} UTC. The key is shown only now:"
            )
            print(key["key"])
        else:
            key = client.revoke_key(args.key_id)
            print(f"{key['id']} revoked")
    return 0


def webhooks(args: argparse.Namespace) -> int:
    with _client(args) as client:
        given = getattr(args, "events", None)
        events = [e.strip() for e in given.split(",") if e.strip()] if given else None
        if args.action == "create":
            hook = client.create_webhook(args.url, events, args.description, args.tenant)
            print(
                f"created {hook['id']} for tenant {hook['tenant']} ({', '.join(hook['events'])}); "
                "its signing secret is shown only now:"
            )
            print(hook["secret"])
        elif args.action == "list":
            print(f"{'ID':<20} {'TENANT':<16} {'CREATED':<18} {'STATE':<24} {'EVENTS':<40} URL")
            for hook in client.list_webhooks(args.tenant)["data"]:
                print(
                    f"{hook['id']:<20} {hook['tenant']:<16} {_when(hook['created_at']):<18} "
                    f"{_webhook_state(hook):<24} {','.join(hook['events']):<40} {hook['url']}"
                )
        elif args.action in ("update", "enable", "disable"):
            fields: dict[str, Any] = {}
            if args.action != "update":
                fields["enabled"] = args.action == "enable"
            else:
                for name in ("url", "description"):
                    if getattr(args, name) is not None:
                        fields[name] = getattr(args, name) or None  # ("": no description)
                if events:
                    fields["events"] = events
            hook = client.update_webhook(args.webhook_id, **fields)
            print(f"{hook['id']}: {_webhook_state(hook)} ({', '.join(hook['events'])}) {hook['url']}")
            if hook["disabled_reason"]:
                print(hook["disabled_reason"])
        elif args.action == "rotate-secret":
            hook = client.rotate_webhook_secret(args.webhook_id, args.old_secret_hours)
            until = hook["old_secret_until"]
            old = f"signs too until {_when(until)}" if until else "no longer signs"
            print(f"{hook['id']} has a new signing secret (the old one {old}), shown only now:")
            print(hook["secret"])
        elif args.action == "retry":
            for delivery_id in args.delivery_ids:
                delivery = client.retry_delivery(args.webhook_id, delivery_id)
                print(f"delivery {delivery['id']} ({delivery['type']}) is sent again")
        elif args.action == "test":
            delivery = client.test_webhook(args.webhook_id)
            print(
                f"sent a {delivery['type']} event (delivery {delivery['id']}): "
                f"tputune webhooks deliveries {args.webhook_id}"
            )
        elif args.action == "deliveries":
            page = client.webhook_deliveries(args.webhook_id, limit=args.limit, status=args.status)
            print(f"{'ID':<8} {'CREATED':<18} {'EVENT':<14} {'JOB':<16} {'STATUS':<10} {'TRIES':>5}  LAST")
            for d in page["data"]:
                last = d["last_error"] or (f"HTTP {d['response_status']}" if d["response_status"] else "")
                if d["status"] == "pending" and d["next_attempt_at"]:
                    last = f"{last}; next try {_when(d['next_attempt_at'])}".lstrip("; ")
                print(
                    f"{d['id']:<8} {_when(d['created_at']):<18} {d['type']:<14} {d['job_id'] or '-':<16} "
                    f"{d['status']:<10} {d['attempts']:>5}  {last}"
                )
        else:
            hook = client.delete_webhook(args.webhook_id)
            print(f"{hook['id']} deleted")
    return 0


def _webhook_state(hook: dict[str, Any]) -> str:
    if not hook["enabled"]:
        return "disabled"
    if hook["failing_since"]:
        return f"failing since {_when(hook['failing_since'])}"
    return "enabled"


def _limit(tenant: dict[str, Any], field: str) -> str:
    """A limit as `8`, `8 (server)` where it is the server's, `unlimited` where the team has none whatever
    the server's, or `none`."""
    value = tenant["limits"][field]
    if tenant["own_limits"][field] == "unlimited":
        return "unlimited"
    if value is None:
        return "none"
    return f"{value}" if tenant["own_limits"][field] is not None else f"{value} (server)"


def _set_by(tenant: dict[str, Any], between: str = " ") -> str | None:
    """Who set a tenant's limits and when (None: nobody has)."""
    if not tenant["updated_at"]:
        return None
    return f"{tenant['updated_by'] or 'the single user'}{between}{_when(tenant['updated_at'])}"


# `tenants set` flags (their dests) and the limits they set, in the order `tenants list` shows them.
_LIMIT_FLAGS = {
    "max_jobs": "max_active_jobs",
    "max_chips": "max_active_chips",
    "max_queued": "max_queued_jobs",
    "max_chip_hours": "max_chip_hours_per_month",
}


def _limit_arg(text: str) -> int | str | None:
    """--max-jobs/--max-chips/--max-queued/--max-chip-hours: a number, `default` (the server's limit), or
    `unlimited` (none, whatever the server's)."""
    if text == "default":
        return None
    if text == "unlimited":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, 'default' or 'unlimited', not {text!r}"
        ) from None


def tenants(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "list":
            rows = client.list_tenants()["data"]
            print(
                f"{'TENANT':<20} {'ACTIVE':>6} {'MAX JOBS':<12} {'CHIPS':>5} {'MAX CHIPS':<12} "
                f"{'QUEUED':>6} {'MAX QUEUED':<12} {'CHIP-H MONTH':>12} {'BUDGET':<12}  SET BY"
            )
            for tenant in rows:
                used = tenant["usage"]
                by = _set_by(tenant) or "-"
                jobs, chips, waiting, budget = (_limit(tenant, field) for field in _LIMIT_FLAGS.values())
                month = f"{used['chip_hours_this_month']:,.1f}"
                print(
                    f"{tenant['name']:<20} {used['active_jobs']:>6} {jobs:<12} {used['chips']:>5} "
                    f"{chips:<12} {used['queued_jobs']:>6} {waiting:<12} {month:>12} {budget:<12}  {by}"
                )
            return 0
        if args.action == "set":
            given = {field: getattr(args, flag) for flag, field in _LIMIT_FLAGS.items()}
            changes = {field: value for field, value in given.items() if value is not False}
            if args.data_prefixes:
                prefixes = args.data_prefixes
                changes["data_prefixes"] = (
                    "any" if prefixes == ["any"] else None if prefixes == ["default"] else prefixes
                )
            if not changes:
                print(
                    "tputune: error: say --max-jobs, --max-chips, --max-queued or --max-chip-hours (a "
                    "number, 'default' or 'unlimited'), or --data-prefix",
                    file=sys.stderr,
                )
                return 2
            tenant = client.set_tenant_limits(args.name, **changes)
        else:
            tenant = client.get_tenant(args.name) if args.name else client.tenant()
    used = tenant["usage"]
    print(f"tenant {tenant['name']}")
    jobs = _limit(tenant, "max_active_jobs")
    queued = _limit(tenant, "max_queued_jobs")
    print(
        f"  jobs:  {used['active_jobs']} active, limit {jobs}; {used['queued_jobs']} queued, limit {queued}"
    )
    print(f"  {tenant['chip_unit']}: {used['chips']} held, limit {_limit(tenant, 'max_active_chips')}")
    budget = _limit(tenant, "max_chip_hours_per_month")
    has_budget = tenant["limits"]["max_chip_hours_per_month"] is not None
    stops = "; running jobs pause at it" if has_budget and tenant.get("budget_pauses_running") else ""
    print(f"  chip-hours this month (UTC): {used['chip_hours_this_month']:,.2f}, budget {budget}{stops}")
    prefixes = tenant["data_prefixes"]
    where = ", ".join(prefixes) if prefixes is not None else "anywhere"
    if tenant["own_data_prefixes"] is None and prefixes is not None:
        where += " (server)"
    print(f"  data:  {where}")
    if prefixes is not None:
        print(f"         and may read {', '.join(tenant['shared_read_prefixes'])}")
    if set_by := _set_by(tenant, " at "):
        print(f"  limits set by {set_by}")
    return 0


def usage(args: argparse.Namespace) -> int:
    with _client(args) as client:
        report = client.usage(args.since, args.until, args.tenant)
    print(f"from {_when(report['since'])} to {_when(report['until'])} UTC ({report['chip_unit']})")
    print(f"{'TENANT':<20} {'JOBS':>6} {'CHIP-HOURS':>12} {'TOKENS':>16}")
    for row in report["data"]:
        hours, tokens = f"{row['chip_hours']:,.2f}", f"{row['trained_tokens']:,}"
        print(f"{row['tenant']:<20} {row['jobs']:>6} {hours:>12} {tokens:>16}")
    return 0


def _change(value: Any) -> str:
    """A value in an audit line: JSON, short."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:79] + "…"


def audit_line(event: dict[str, Any]) -> str:
    """One audit event: when, what, whose, by whom, and what changed."""
    actor = event["actor"]
    team = f" ({actor['tenant']})" if actor["tenant"] else ""
    by = f"{actor['who']}{team}" if actor["who"] else "the single user"
    changes = []
    for field, value in event["details"].items():
        if isinstance(value, dict) and set(value) == {"from", "to"}:
            changes.append(f"{field} {_change(value['from'])} -> {_change(value['to'])}")
        else:
            changes.append(f"{field} {_change(value)}")
    stamp = _time(event["at"]).strftime("%Y-%m-%d %H:%M:%S")
    line = f"{stamp}  {event['action']:<22} {event['tenant']:<16} {event['target']:<18} by {by}"
    return line + ("\n    " + "; ".join(changes) if changes else "")


def audit(args: argparse.Namespace) -> int:
    shown, after = 0, None
    with _client(args) as client:
        while shown < args.limit:
            page = client.audit(
                args.tenant,
                args.action,
                args.actor,
                args.target,
                args.since,
                after,
                min(100, args.limit - shown),
            )
            for event in page["data"]:
                print(audit_line(event))
            shown += len(page["data"])
            if not page["has_more"]:
                break
            after = page["next_after"]
    if not shown:
        print("no audit events")
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tputune", description="Fine-tune Gemma 3 with JAX on TPUs.")
    root.add_argument("--api-url", help="API base URL (env TPUTUNE_API_URL, default http://127.0.0.1:8000)")
    root.add_argument("--api-key", help="API key (env TPUTUNE_API_KEY)")
    commands = root.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the API (migrates the database first)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--workers",
        type=int,
        help="API processes sharing the port (env TPUTUNE_WORKERS, default 1; 0: one per core, at most 4)",
    )
    p.set_defaults(func=serve)
    p = commands.add_parser("migrate", help="upgrade (or --down: downgrade) the database schema")
    p.add_argument("revision", nargs="?", default="head")
    p.add_argument("--down", action="store_true")
    p.set_defaults(func=migrate)

    p = commands.add_parser("submit", help="create a job from flags and/or a YAML/JSON spec file")
    p.add_argument("spec", nargs="?", help="spec file (.yaml, .yml or .json)")
    p.add_argument("--name")
    p.add_argument("--model")
    p.add_argument("--dataset", help="dataset URI (gs://… or an absolute path)")
    p.add_argument(
        "--from-job",
        help="start from the weights of an earlier job of your team (its final export, once it succeeded)",
    )
    p.add_argument(
        "--from-step", type=int, help="with --from-job: start from that job's checkpoint at this step instead"
    )
    p.add_argument("--method", choices=["full", "lora"])
    p.add_argument("--lora-rank", type=int)
    p.add_argument(
        "--objective",
        choices=["sft", "dpo"],
        help="sft: learn the data's texts and replies (default); dpo: learn from preference pairs",
    )
    p.add_argument(
        "--dpo-beta", type=float, help="dpo: how far from its start the model may move (default 0.1)"
    )
    p.add_argument(
        "--export-hf", action="store_true", help="also export a Hugging Face model (final/hf: safetensors)"
    )
    # (the types are not checked here: the client commands never import the spec's models, pydantic; the
    # API answers a wrong one with the types it takes)
    p.add_argument(
        "--export-gguf",
        metavar="TYPE",
        help="also export a GGUF file for llama.cpp and ollama, its matrices in TYPE: f32, f16, bf16 or q8_0",
    )
    p.add_argument("--epochs", type=int)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--learning-rate", "--lr", type=float)
    p.add_argument("--max-seq-len", type=int)
    p.add_argument("--processes", type=int, help="local executor: JAX processes")
    p.add_argument(
        "--set", action="append", metavar="PATH=VALUE", help="any spec field, e.g. hyperparameters.seed=3"
    )
    p.add_argument("--idempotency-key")
    p.add_argument("--follow", "-f", action="store_true", help="watch the job until it ends")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=submit)

    p = commands.add_parser("list", help="list jobs, newest first")
    p.add_argument("--status", action="append")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--after", help="a job id: list the jobs older than it (the next page)")
    p.add_argument("--tenant", help="only this tenant's jobs (the admin key lists every tenant's)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--json", action="store_true")
    which.add_argument(
        "--quiet", "-q", action="store_true", help="only the jobs' ids (e.g. for tputune delete $(...))"
    )
    p.set_defaults(func=list_jobs)

    p = commands.add_parser("status", help="show a job")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=status)

    p = commands.add_parser(
        "watch", help="live progress until the job ends; exit code 0/1/2 = succeeded/failed/cancelled"
    )
    p.add_argument("job_id")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=watch)

    p = commands.add_parser("events", help="a job's events")
    p.add_argument("job_id")
    p.add_argument("--after", type=int)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--follow", "-f", action="store_true")
    p.set_defaults(func=events)

    p = commands.add_parser("logs", help="the worker's log")
    p.add_argument("job_id")
    p.add_argument("--tail", type=int, default=200)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--follow", "-f", action="store_true")
    which.add_argument(
        "--previous",
        action="store_true",
        help="GKE: the log saved as the job's last run ended (a failed one's)",
    )
    which.add_argument(
        "--run",
        type=int,
        metavar="N",
        help="GKE: the log saved as run N of the job ended (0 its first; each pause, and each resume after "
        "a failure, starts the next)",
    )
    p.set_defaults(func=logs)

    p = commands.add_parser("cancel", help="cancel a job")
    p.add_argument("job_id")
    p.set_defaults(func=act, action="cancel")

    p = commands.add_parser(
        "delete",
        help="delete jobs that ended, with their events and logs (their outputs stay; their use is counted)",
    )
    p.add_argument("job_ids", nargs="+", metavar="job_id")
    p.set_defaults(func=delete)

    p = commands.add_parser(
        "pause", help="pause a job: its workers save a checkpoint and stop, and it lets its chips go"
    )
    p.add_argument("job_id")
    p.set_defaults(func=act, action="pause")

    p = commands.add_parser(
        "resume", help="queue a paused or failed job again; it goes on from its last checkpoint"
    )
    p.add_argument("job_id")
    p.set_defaults(func=act, action="resume")

    p = commands.add_parser("metrics", help="a job's loss, token accuracy and more at each step")
    p.add_argument("job_id")
    p.add_argument("--min-step", type=int, help="from this step")
    p.add_argument("--max-step", type=int, help="up to this step")
    p.add_argument("--every", type=int, default=1, help="every N-th step (and each eval's, and the last)")
    p.add_argument("--csv", action="store_true", help="CSV with every column, to plot")
    p.set_defaults(func=metrics)

    p = commands.add_parser("checkpoints", help="a job's checkpoints")
    p.add_argument("job_id")
    p.set_defaults(func=checkpoints)

    p = commands.add_parser("keys", help="manage API keys (needs the admin key)")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("create", help="create a key for a tenant (printed once)")
    a.add_argument("--tenant", required=True)
    a.add_argument("--name", required=True)
    a.add_argument(
        "--expires-in-days", type=int, help="the key stops working after this many days (default: never)"
    )
    a.add_argument(
        "--admin", action="store_true", help="an admin key: manages keys, sees every tenant's jobs"
    )
    a.add_argument(
        "--read-only",
        action="store_true",
        help="a key that only reads (dashboards, monitoring); with --admin an auditor's (every team's)",
    )
    a = actions.add_parser("list", help="list keys")
    a.add_argument("--tenant", help="only this tenant's")
    a = actions.add_parser("rotate", help="replace a key: a new one (printed once), the old one expires")
    a.add_argument("key_id")
    a.add_argument(
        "--grace-seconds",
        type=int,
        default=0,
        help="how long the old key goes on working (default 0: it stops now)",
    )
    a.add_argument("--expires-in-days", type=int, help="the new key's lifetime (default: the old key's)")
    a = actions.add_parser("revoke", help="revoke a key")
    a.add_argument("key_id")
    p.set_defaults(func=keys)

    p = commands.add_parser("webhooks", help="endpoints told when your jobs start, pause and end")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("create", help="add an endpoint (its signing secret is printed once)")
    a.add_argument("url", help="https URL the events are posted to")
    a.add_argument(
        "--events",
        help="comma-separated, of job.running, job.paused, job.succeeded, job.failed, job.cancelled "
        "(default: the last three)",
    )
    a.add_argument("--description")
    a.add_argument("--tenant", help="another tenant's, or '*' for every tenant's jobs (admin keys only)")
    a = actions.add_parser("list", help="list endpoints")
    a.add_argument("--tenant", help="only this tenant's (admin keys)")
    a = actions.add_parser("update", help="change an endpoint's URL, events or description")
    a.add_argument("webhook_id")
    a.add_argument("--url")
    a.add_argument("--events", help="comma-separated, as for create")
    a.add_argument("--description", help='"" for none')
    for action, what in (
        ("enable", "send to it again (after fixing an endpoint the server disabled)"),
        ("disable", "send nothing more to it (its pending deliveries are given up)"),
    ):
        a = actions.add_parser(action, help=what)
        a.add_argument("webhook_id")
    a = actions.add_parser("test", help="send a webhook.test event (also to a disabled endpoint)")
    a.add_argument("webhook_id")
    a = actions.add_parser("rotate-secret", help="a new signing secret (printed once)")
    a.add_argument("webhook_id")
    a.add_argument(
        "--old-secret-hours",
        type=float,
        help="how long deliveries are signed with the old secret too (default 24; 0: not at all)",
    )
    a = actions.add_parser("retry", help="send failed deliveries again (what an endpoint missed)")
    a.add_argument("webhook_id")
    a.add_argument("delivery_ids", nargs="+", type=int, metavar="delivery_id")
    a = actions.add_parser("deliveries", help="an endpoint's deliveries, newest first, and how each went")
    a.add_argument("webhook_id")
    a.add_argument("--status", choices=["pending", "delivered", "failed"])
    a.add_argument("--limit", type=int, default=20)
    a = actions.add_parser("delete", help="delete an endpoint")
    a.add_argument("webhook_id")
    p.set_defaults(func=webhooks)

    p = commands.add_parser(
        "tenants", help="teams' limits on running and queued jobs and chips, and their use"
    )
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("show", help="a team's limits and use (default: your own)")
    a.add_argument("name", nargs="?", help="a tenant (needs an admin key)")
    actions.add_parser("list", help="every team's (needs an admin key)")
    a = actions.add_parser("set", help="set a team's limits (needs an admin key)")
    a.add_argument("name")
    a.add_argument(
        "--max-jobs",
        type=_limit_arg,
        default=False,
        help="jobs active at once (0: none start); 'default': the server's limit; 'unlimited': none",
    )
    a.add_argument(
        "--max-chips",
        type=_limit_arg,
        default=False,
        help="TPU chips (local executor: processes) its active jobs may hold; 'default': the server's; "
        "'unlimited': none",
    )
    a.add_argument(
        "--max-queued",
        type=_limit_arg,
        default=False,
        help="jobs waiting to start; more are refused (0: no new jobs); 'default': the server's; "
        "'unlimited': none",
    )
    a.add_argument(
        "--max-chip-hours",
        type=_limit_arg,
        default=False,
        help="chip-hours its jobs may hold in a calendar month (UTC); then its queued jobs wait for the "
        "next month; 'default': the server's; 'unlimited': none",
    )
    a.add_argument(
        "--data-prefix",
        action="append",
        dest="data_prefixes",
        help="where its jobs may read and write: a gs://bucket/path or local directory prefix ({tenant}: "
        "its name); give it again for more; 'any': anywhere; 'default': the server's",
    )
    p.set_defaults(func=tenants)

    p = commands.add_parser("usage", help="chip-hours and tokens each team's jobs ran (your own team's)")
    p.add_argument("--since", help="from (ISO 8601, e.g. 2026-11-01; default: 30 days before --until)")
    p.add_argument("--until", help="until (ISO 8601; default: now)")
    p.add_argument("--tenant", help="only this tenant's (an admin key sees every tenant's)")
    p.set_defaults(func=usage)

    p = commands.add_parser(
        "audit", help="who changed keys, teams' limits and webhooks, newest first (your own team's)"
    )
    p.add_argument("--tenant", help="only this team's (an admin key sees every team's)")
    p.add_argument(
        "--action", action="append", help="only this action (key.created, tenant.updated, ...); repeatable"
    )
    p.add_argument("--actor", help="only what this key did (its id, or 'admin')")
    p.add_argument("--target", help="only about this key, team or webhook endpoint")
    p.add_argument("--since", help="from (ISO 8601, e.g. 2026-11-01)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.set_defaults(func=audit)

    p = commands.add_parser(
        "check-data", help="read and tokenize a dataset as a job would: its records, tokens and rows"
    )
    p.add_argument("dataset", help="a .txt, .jsonl or .parquet file (or gs:// URI)")
    p.add_argument(
        "--tokenizer",
        help="a SentencePiece .model or a .gguf file (default: the official Gemma 3 one, gs://)",
    )
    p.add_argument("--max-seq-len", type=int, default=512, help="the job's max_seq_len (default 512)")
    p.add_argument(
        "--train-on-inputs", action="store_true", help="as the hyperparameter: the inputs trained too"
    )
    p.set_defaults(func=check_data)

    p = commands.add_parser("demo", help="fine-tune Gemma 3 270M on generated stories, end to end")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--stop-server", action="store_true", help="stop the API at the end (default: keep it up)")
    p.set_defaults(func=demo)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn  # (a line of its own, not the source line that warned)
            return int(args.func(args))
    except ApiError as exc:
        print(f"error: {exc.message} ({exc.code})", file=sys.stderr)
        return 3
    except Exception as exc:
        if not _settings_error(exc):
            raise
        for error in exc.errors(include_url=False):  # type: ignore[attr-defined]  # (names, not a traceback)
            name = "TPUTUNE_" + "_".join(str(part) for part in error["loc"]).upper()
            print(f"tputune: {name}: {error['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _warn(message: Warning | str, *_where: object, **_how: object) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _settings_error(exc: Exception) -> bool:
    """Whether `exc` is invalid settings (pydantic's ValidationError; not imported for it: the client
    commands never load pydantic, ~90 ms)."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError) and exc.title == "Settings"


if __name__ == "__main__":
    sys.exit(main())
