"""`tputune`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys

from api.settings import Settings


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.main import create_app
    from api.migrate import upgrade

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    settings.ensure_dirs()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    print(f"tputune: serving on http://{settings.host}:{settings.port} (docs at /docs)", flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
    return 0


def migrate(args: argparse.Namespace) -> int:
    from api.migrate import downgrade, upgrade

    url = Settings().resolved_database_url
    if args.revision.startswith("-") or args.down:
        downgrade(url, args.revision)
    else:
        upgrade(url, args.revision)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tputune", description="Fine-tune Gemma 3 with JAX on TPUs.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve", help="run the API (migrates the database first)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(func=serve)
    p = commands.add_parser("migrate", help="upgrade (or --down: downgrade) the database schema")
    p.add_argument("revision", nargs="?", default="head")
    p.add_argument("--down", action="store_true")
    p.set_defaults(func=migrate)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
