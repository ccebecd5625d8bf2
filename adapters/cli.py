"""The `relayline` command: check, plan, simulate, serve, ledger, diagram, demo. Each subcommand
is a thin shell over the same objects an embedder uses.

An operator's mistake (a bad config, a port in use, a closed pipe) ends in one line on stderr and
a non-zero exit, never a traceback: 1 for a command that ran and failed, 2 for one that could not
start (argparse's usage errors, a config that does not load, a key variable that is unset).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from relayline.machines.config import Config, join_path, structure_config
from relayline.machines.errors import ConfigError
from relayline.machines.families import FAMILIES, WIRES
from relayline.machines.plan import build_router, plan_turn

from .configfile import load_config_file, read_config_file
from .logs import LEVELS, configure

# plan.py prunes these with a warning (a library keeps running); an operator's `check` refuses
# them: a route that names no profile is a typo that silently sends its traffic elsewhere
CHECK_ERRORS = {"unknown_route_provider"}


def cmd_check(args: argparse.Namespace) -> int:
    from .gateway.auth import KEYLESS_NOTE, keyless, load_access

    problems = []
    raw: dict[str, Any] = {}
    try:
        raw = read_config_file(args.config)
        config = structure_config(raw)
        router = build_router(config, os.environ)
    except ConfigError as exc:
        problems = list(exc.problems)
        # what the router would also refuse, read from the file as written: one pass shows every
        # problem (a bad base_url must not hide a misspelled family)
        problems += [p for p in _profile_problems(raw) if p not in problems]
    else:
        problems += [f"{w.path}: {w.message}" for w in router.warnings if w.code in CHECK_ERRORS]
        try:
            load_access(config, os.environ)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        print(f"error: {args.config}: configuration is not usable", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    warnings = [str(w) for w in router.warnings if w.code not in CHECK_ERRORS]
    # a profile that says nothing about price is billed at 0: say so (a free local model can say
    # `price = { input_per_mtok = 0, output_per_mtok = 0 }`)
    warnings += [f"missing_price at {join_path('providers', alias)}.price: no price, so its "
                 "attempts cost 0 "
                 "in the ledger" for alias, p in config.providers.items()
                 if p.family != "sim" and not {"price", "prices"} & set(raw["providers"][alias])]
    if keyless(config):
        warnings.append(f"no_client_keys at gateway.api_keys_env: {KEYLESS_NOTE}")
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"ok: {args.config}: {len(config.providers)} profiles, {len(router.domains)} routes, "
          f"{len(router.catalog)} catalog models, {len(warnings)} warnings")
    return 0


def _profile_problems(raw: dict[str, Any]) -> list[str]:
    """The unknown families and unset key variables of the profiles of a file that did not load,
    in the router's words."""
    problems = []
    providers = raw.get("providers")
    for alias, profile in (providers if isinstance(providers, dict) else {}).items():
        if not isinstance(profile, dict):
            continue
        where = join_path("providers", alias)
        family, variable = profile.get("family"), profile.get("api_key_env")
        if isinstance(family, str) and family not in FAMILIES:
            problems.append(f"{where}.family: unknown family {family!r} (known: "
                            f"{', '.join(FAMILIES)})")
        if isinstance(variable, str) and variable and not os.environ.get(variable):
            problems.append(f"{where}.api_key_env: environment variable {variable} is not set")
    return problems


class _PlanningEnv(Mapping[str, str]):
    """The environment as `plan` reads it: it sends nothing, so a key variable that is unset is
    noted (`unset`) and stands in as a placeholder, never an error."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.unset: set[str] = set()

    def __getitem__(self, name: str) -> str:
        value = self.env.get(name, "")
        if not value:
            self.unset.add(name)
            return "unset"
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


def cmd_plan(args: argparse.Namespace) -> int:
    env = _PlanningEnv(os.environ)
    try:
        router = build_router(load_config_file(args.config), env)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    if env.unset:
        print("note: unset key variables (plan sends nothing; serve needs them): "
              f"{', '.join(sorted(env.unset))}",
              file=sys.stderr)
    plan = plan_turn(router, model=args.model, text=args.text or "",
                     operator_model=args.operator_model,
                     gateway=args.gateway)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
        return 0
    print(f"domain:    {plan.domain}" + (f"  (hint:{plan.hint})" if plan.hint else ""))
    if plan.catalog:
        print(f"catalog:   {plan.catalog.model}: {len(plan.catalog.channels)} channels, order "
              f"{plan.catalog.order}, "
              f"max_hops {plan.catalog.max_hops}")
    print(f"requested: {plan.requested}")
    if plan.effort:
        print(f"effort:    {plan.effort.level} -> hint:{plan.effort.hint} (score "
              f"{plan.effort.score})")
    print("allowlist: "
          f"{', '.join(sorted(plan.allowlist)) if plan.allowlist is not None else 'any profile'}")
    print()
    pw = max([24, *(len(e.profile) for e in plan.entries)])
    mw = max([28, *(len(e.model) for e in plan.entries)])
    print(f"  {'#':>2}  {'provider':<{pw}} {'model':<{mw}} {'pinned':<6} {'$/Mtok in':>9} "
          f"{'out':>7}  {'allowed'}")
    for e in plan.entries:
        print(f"  {e.index + 1:>2}  {e.profile:<{pw}} {e.model:<{mw}} "
              f"{'yes' if e.pinned else 'no':<6} "
              f"{e.price.input_per_mtok:>9.2f} {e.price.output_per_mtok:>7.2f}  "
              f"{'yes' if plan.allows(e.profile) else 'no (allowlist)'}")
    for warning in plan.warnings:
        print(f"warning: {warning}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from .sim.simulate import main

    return main(args.files, as_json=args.json, http=args.http)


def cmd_diagram(args: argparse.Namespace) -> int:
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


def cmd_serve(args: argparse.Namespace) -> int:
    import trio

    from .gateway import Gateway, run_until_signalled
    from .gateway.reload import EarlyReloads, Reloader, ask_supervisor_to_reload
    from .gateway.serving import tune_collector
    from .providers.http import decode_in_worker_processes
    from .relay import Relay

    # a SIGHUP before the gateway listens for it is kept for then (by default it would end the
    # process; ignored, a worker starting while its fleet reloaded would miss the reload)
    early = EarlyReloads().hold()
    if args.workers > 1:
        from .gateway.workers import LastGood, supervise

        if not args.config:
            print("error: --workers needs --config (every worker loads the same file)",
                  file=sys.stderr)
            return 2
        try:
            last_good = LastGood(args.config, os.environ, args.host)
            refuse_open_bind(last_good.config, args.host)
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            return 2
        try:
            return supervise(last_good, host=args.host, port=args.port, workers=args.workers,
                             early=early,
                             worker_args=("--log-level", args.log_level, "--log-format",
                                          args.log_format,
                                          "--fleet-size", str(args.workers)))
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 1
        finally:
            early.close()
    try:
        if args.config:
            relay = Relay(load_config_file(args.start_config or args.config))
        else:
            from .sim.demo import builtin_relay

            relay = builtin_relay()
            print("no --config: serving the built-in demo config on in-process sim upstreams",
                  file=sys.stderr)
        if args.listen_fd is None:  # (a worker's socket: its supervisor checked the address)
            refuse_open_bind(relay.config, args.host)
        gateway = Gateway.from_relay_config(relay)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.config:
        reloader = Reloader(gateway, args.config)  # SIGHUP and POST /admin/reload
        reloader.host = args.host
        if args.supervisor is not None:
            reloader.fleet = partial(ask_supervisor_to_reload, args.supervisor)
        gateway.reloader = reloader
    # a worker's share of a limit when the fleet shares no store
    gateway.limiter.workers = args.fleet_size

    def listening(binds: list[str]) -> None:
        print(f"relayline gateway listening on {', '.join(binds)}", file=sys.stderr, flush=True)

    # the event loop serves every client: large answers decode elsewhere
    decode_in_worker_processes()
    tune_collector()
    try:
        trio.run(partial(run_until_signalled, gateway, host=args.host, port=args.port,
                         fd=args.listen_fd,
                         on_listening=listening, early=early))
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    finally:
        early.close()
    return 0


def refuse_open_bind(config: Config, host: str) -> None:
    """ConfigError when a gateway without client keys would listen where others can reach it."""
    from .gateway.auth import bind_refusal

    refusal = bind_refusal(config, host)
    if refusal is not None:
        raise ConfigError([refusal])


def cmd_ledger(args: argparse.Namespace) -> int:
    from relayline.machines.config import Ledger

    from .stores.ledger import DEFAULT_PATH, LedgerStore, open_ledger, parse_since

    try:
        since = parse_since(args.since)
        config = load_config_file(args.config).ledger if args.config else Ledger()
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
        report = store.report(since, by=args.by)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"path": where, "since": since, "by": args.by, "rows": report}, indent=2))
        return 0
    if args.by in _CALLER_COLUMNS:
        column, heading, blank = _CALLER_COLUMNS[args.by]
        print(f"{heading:<24} {'accepted':>8} {'rejected':>8} {'estimated':>9} {'accepted $':>12} "
              f"{'rejected $':>12}")
        for row in report:
            print(f"{row[column] or blank:<24} {row['accepted']:>8} {row['rejected']:>8} "
                  f"{row['estimated']:>9} "
                  f"{row['accepted_cost_usd']:>12.6f} {row['rejected_cost_usd']:>12.6f}")
    else:
        _print_model_report(report)
    total = sum(r["accepted_cost_usd"] + r["rejected_cost_usd"] for r in report)
    print(f"total ${total:.6f}")
    return 0


# `ledger --by` a caller: the report's column, its heading, and what a row without one says
_CALLER_COLUMNS = {"client": ("client", "client", "(no key)"),
                   "key": ("key_name", "key", "(no named key)"),
                   "team": ("team", "team", "(no team)")}


def _print_model_report(report: list[dict[str, Any]]) -> None:
    print(f"{'provider':<24} {'model':<28} {'accepted':>8} {'rejected':>8} {'estimated':>9} "
          f"{'accepted $':>12} "
          f"{'rejected $':>12}")
    for row in report:
        print(f"{row['provider']:<24} {row['model']:<28} {row['accepted']:>8} {row['rejected']:>8} "
              f"{row['estimated']:>9} "
              f"{row['accepted_cost_usd']:>12.6f} {row['rejected_cost_usd']:>12.6f}")


def cmd_demo(args: argparse.Namespace) -> int:
    from .sim.demo import main

    return main(simulated=args.simulated)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("a port is a number from 0 to 65535 (0: any free port), "
                                         f"got {text!r}")
    return port


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return n


def _version() -> str:
    try:
        return metadata.version("relayline")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "unknown"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default; a default of None (nothing set) is not worth a line."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relayline", formatter_class=_Help,
                                     description="LLM provider routing that stays correct when "
                                                 "providers fail.")
    parser.add_argument("--version", action="version", version=f"relayline {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help: str,
                func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        p.set_defaults(func=func)
        return p

    p = command("check",
                "validate a config: exit 0 (warnings printed) or 1 (errors printed, each with its "
                "key path)",
                cmd_check)
    p.add_argument("config", help="the relayline TOML config")

    p = command("plan", "print the exact attempt order for a config and a model or hint", cmd_plan)
    p.add_argument("config", help="the relayline TOML config")
    p.add_argument("--model",
                   help="the requested model, or hint:NAME (default: the active profile's)")
    p.add_argument("--text", help="the turn text (drives effort routing)")
    p.add_argument("--operator-model", dest="operator_model",
                   help="an explicit operator selection (auto: none)")
    p.add_argument("--gateway", action="store_true",
                   help="resolve a bare route hint as the gateway does")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")

    p = command("simulate",
                "run scenario files on virtual time; exit 1 if an expectation fails (the file "
                "format: "
                "docs/scenario-files.md)", cmd_simulate)
    p.add_argument("files", nargs="+",
                   help="scenario TOML files: a config, scripted replies, requests and their "
                   "expectations (docs/scenario-files.md)")
    p.add_argument("--json", action="store_true", help="print the trace and check nothing")
    p.add_argument("--http", choices=WIRES,
                   help="serve the sim profiles over real loopback HTTP in this protocol's shape")

    p = command("serve",
                "run the OpenAI- and Anthropic-compatible gateway (SIGTERM or Ctrl-C drains it)",
                cmd_serve)
    p.add_argument("--config",
                   help="a relayline config (default: the built-in demo config on sim upstreams)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=_port, default=8080,
                   help="the port to listen on (0: any free port)")
    p.add_argument("--workers", type=_positive, default=1,
                   help="worker processes on the one port (they share health only with [health] "
                        "store = redis://)")
    # a worker's inherited socket
    p.add_argument("--listen-fd", dest="listen_fd", type=int, help=argparse.SUPPRESS)
    # a worker's first config: the supervisor's copy of the last good file (its reloads read
    # --config)
    p.add_argument("--start-config", dest="start_config", help=argparse.SUPPRESS)
    # a worker's supervisor: the process an admin reload asks to reload the whole fleet
    p.add_argument("--supervisor", dest="supervisor", type=int, help=argparse.SUPPRESS)
    p.add_argument("--fleet-size", dest="fleet_size", type=_positive, default=1,
                   help=argparse.SUPPRESS)  # how many workers the supervisor started
    p.add_argument("--log-level", dest="log_level", choices=LEVELS, default="info",
                   help="the least severe records logged (info: one access line per request)")
    p.add_argument("--log-format", dest="log_format", choices=["text", "json"], default="text",
                   help="key=value lines or one JSON object per line, on stderr")

    p = command("ledger",
                "report cost per profile and model (or per client key, named key or team) from the "
                "ledger (SQLite or "
                "PostgreSQL)", cmd_ledger)
    p.add_argument("--config", help="read [ledger] url or path from this config")
    p.add_argument("--path",
                   help="the SQLite ledger file (default: [ledger] path, else "
                        "relayline-ledger.sqlite3)")
    p.add_argument("--url", help="a PostgreSQL ledger: postgresql://user@host/db")
    p.add_argument("--since",
                   help="only rows newer than this: 90s, 15m, 1h, 2d (default: every row)")
    p.add_argument("--by", choices=["model", "client", "key", "team"], default="model",
                   help="group by profile and model, by the gateway client's key id, or by a named "
                        "key or its team")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = command("diagram", "write Mermaid and DOT diagrams of every lifecycle spec", cmd_diagram)
    p.add_argument("--check", action="store_true", help="exit 1 when a checked-in diagram is stale")
    p.add_argument("--out", help="the diagrams folder (default: specs/diagrams of the source tree)")

    p = command("demo", "run the demo storyline: gateway, sim upstreams, the openai SDK", cmd_demo)
    p.add_argument("--simulated", action="store_true",
                   help="the in-process storyline on virtual time instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "serve":
        configure(args.log_level, args.log_format)
    else:
        # the other commands print what matters themselves: their log stays quiet unless asked
        # (RELAYLINE_LOG=INFO shows every turn of a simulation)
        configure(os.environ.get("RELAYLINE_LOG", "error"))
    run: Callable[[argparse.Namespace], int] = args.func  # (set_defaults, by `command`)
    try:
        return run(args)
    except BrokenPipeError:
        # the reader went away (`relayline plan --json | head`): nothing left to say to it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
