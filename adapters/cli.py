"""The `relayline` command: simulate, check, plan, diagram, demo (serve and ledger come with the
gateway). Each subcommand is a thin shell over the same objects an embedder uses."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tomllib
from pathlib import Path

from relayline.machines.config import structure_config
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router, plan_turn


def _load_config_file(path: str):
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None
    # a scenario file carries its config under [config]: accept it, operators copy them around
    if "config" in raw and "active" not in raw:
        raw = raw["config"]
    return structure_config(raw)


def cmd_check(args) -> int:
    try:
        config = _load_config_file(args.config)
        router = build_router(config, os.environ)
    except ConfigError as exc:
        print(f"error: {args.config}: configuration is not usable", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    for warning in router.warnings:
        print(f"warning: {warning}")
    print(f"ok: {args.config}: {len(config.providers)} profiles, {len(router.domains)} routes, "
          f"{len(router.catalog)} catalog models, {len(router.warnings)} warnings")
    return 0


def cmd_plan(args) -> int:
    try:
        router = build_router(_load_config_file(args.config), os.environ)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    plan = plan_turn(router, model=args.model, text=args.text or "", operator_model=args.operator_model,
                     gateway=args.gateway)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
        return 0
    print(f"domain:    {plan.domain}" + (f"  (hint:{plan.hint})" if plan.hint else ""))
    if plan.catalog:
        print(f"catalog:   {plan.catalog.model}: {len(plan.catalog.channels)} channels, order {plan.catalog.order}, "
              f"max_hops {plan.catalog.max_hops}")
    print(f"requested: {plan.requested}")
    if plan.effort:
        print(f"effort:    {plan.effort.level} -> hint:{plan.effort.hint} (score {plan.effort.score})")
    print(f"allowlist: {', '.join(sorted(plan.allowlist)) if plan.allowlist is not None else 'any profile'}")
    print()
    pw = max([24, *(len(e.profile) for e in plan.entries)])
    mw = max([28, *(len(e.model) for e in plan.entries)])
    print(f"  {'#':>2}  {'provider':<{pw}} {'model':<{mw}} {'pinned':<6} {'$/Mtok in':>9} {'out':>7}  {'allowed'}")
    for e in plan.entries:
        print(f"  {e.index + 1:>2}  {e.profile:<{pw}} {e.model:<{mw}} {'yes' if e.pinned else 'no':<6} "
              f"{e.price.input_per_mtok:>9.2f} {e.price.output_per_mtok:>7.2f}  "
              f"{'yes' if plan.allows(e.profile) else 'no (allowlist)'}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    return 0


def cmd_simulate(args) -> int:
    from .sim.simulate import main

    return main(args.files, as_json=args.json, http=args.http)


def cmd_diagram(args) -> int:
    from .diagrams import check, write

    root = Path(args.out) if args.out else None
    if args.check:
        stale = check(root)
        for name in stale:
            print(f"stale: {name} (run `relayline diagram` or `make diagrams`)", file=sys.stderr)
        if not stale:
            print("diagrams are up to date")
        return 1 if stale else 0
    for path in write(root):
        print(f"wrote {path}")
    return 0


def cmd_serve(args) -> int:
    import trio

    from .gateway import Gateway, serve
    from .relay import Relay

    if args.config:
        try:
            relay = Relay(_load_config_file(args.config))
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            return 1
    else:
        from .sim.demo import builtin_relay

        relay = builtin_relay()
        print("no --config: serving the built-in demo config on in-process sim upstreams", file=sys.stderr)
    gateway = Gateway.from_relay_config(relay)

    async def main():
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: serve(gateway, host=args.host, port=args.port,
                                                                  task_status=task_status))
            print(f"relayline gateway listening on {', '.join(binds)}", file=sys.stderr)

    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_ledger(args) -> int:
    from relayline.machines.config import Ledger

    from .stores.ledger import DEFAULT_PATH, LedgerStore, open_ledger, parse_since

    try:
        since = parse_since(args.since)
        config = _load_config_file(args.config).ledger if args.config else Ledger()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    url = args.url or (None if args.path else config.url)
    if url:
        where = url.rsplit("@", 1)[-1]  # never the password
        try:
            store = open_ledger(Ledger(url=url))
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        where = args.path or config.path or DEFAULT_PATH
        if not Path(where).exists():
            print(f"error: no ledger at {where}", file=sys.stderr)
            return 1
        store = LedgerStore(where)
    try:
        report = store.report(since)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"path": where, "since": since, "rows": report}, indent=2))
        return 0
    print(f"{'provider':<24} {'model':<28} {'accepted':>8} {'rejected':>8} {'accepted $':>12} {'rejected $':>12}")
    for row in report:
        print(f"{row['provider']:<24} {row['model']:<28} {row['accepted']:>8} {row['rejected']:>8} "
              f"{row['accepted_cost_usd']:>12.6f} {row['rejected_cost_usd']:>12.6f}")
    total = sum(r["accepted_cost_usd"] + r["rejected_cost_usd"] for r in report)
    print(f"total ${total:.6f}")
    return 0


def cmd_demo(args) -> int:
    from .sim.demo import main

    return main(simulated=args.simulated)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relayline", description="LLM provider routing that stays correct when providers fail.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="validate a config: exit 0 (warnings printed) or 1 (errors printed)")
    p.add_argument("config")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("plan", help="print the exact attempt order for a config and a model or hint")
    p.add_argument("config")
    p.add_argument("--model")
    p.add_argument("--text", help="the turn text (drives effort routing)")
    p.add_argument("--operator-model", dest="operator_model")
    p.add_argument("--gateway", action="store_true", help="resolve a bare route hint as the gateway does")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="run scenario files on virtual time; exit 1 if an expectation fails")
    p.add_argument("files", nargs="+")
    p.add_argument("--json", action="store_true", help="print the trace and check nothing")
    p.add_argument("--http", choices=["openai", "anthropic"],
                   help="serve the sim profiles over real loopback HTTP in this protocol's shape")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("diagram", help="write Mermaid and DOT diagrams of every lifecycle spec")
    p.add_argument("--check", action="store_true", help="exit 1 when a checked-in diagram is stale")
    p.add_argument("--out", help="the diagrams folder (default: specs/diagrams of the source tree)")
    p.set_defaults(func=cmd_diagram)

    p = sub.add_parser("serve", help="run the OpenAI-compatible gateway")
    p.add_argument("--config", help="a relayline config (default: the built-in demo config on sim upstreams)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ledger", help="report cost per profile and model from the ledger (SQLite or PostgreSQL)")
    p.add_argument("--config", help="read [ledger] url or path from this config")
    p.add_argument("--path", help="the SQLite ledger file (default: relayline-ledger.sqlite3)")
    p.add_argument("--url", help="a PostgreSQL ledger: postgresql://user@host/db")
    p.add_argument("--since", help="only rows newer than this: 90s, 15m, 1h, 2d")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ledger)

    p = sub.add_parser("demo", help="run the demo storyline: gateway, sim upstreams, the openai SDK")
    p.add_argument("--simulated", action="store_true", help="the in-process storyline on virtual time instead")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # structured key=value lines on stderr; RELAYLINE_LOG=INFO shows every turn. The simulator
    # and check print warnings themselves, so their log stays quiet unless asked.
    quiet = args.command in ("simulate", "check", "plan", "demo")
    level = os.environ.get("RELAYLINE_LOG", "ERROR" if quiet else "WARNING").upper()
    logging.basicConfig(level=level, format="level=%(levelname)s logger=%(name)s %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
