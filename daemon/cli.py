"""The `loadmesh` command: the agent itself and the operator's commands that talk to it."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from loadmesh.daemon import config as config_mod
from loadmesh.daemon import cli_simulate, logs, render
from loadmesh.daemon.client import AgentUnavailable, ApiError, Client

def _fail(message: str, code: int = 1) -> int:
    print(f"loadmesh: {render.printable(message)}", file=sys.stderr)
    return code


def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return str(args.socket)
    if args.config:
        return config_mod.load(args.config).api.socket
    return os.environ.get("LOADMESH_SOCKET", config_mod.ApiConfig().socket)


def _query(args: argparse.Namespace, path: str) -> Any:
    with Client(_socket_path(args)) as client:
        return client.get(path)


def cmd_agent(args: argparse.Namespace) -> int:
    from loadmesh.daemon.agent import Agent  # keeps the operator commands from importing the agent

    config = config_mod.load(args.config)
    logs.setup(config.log_level)
    # The probe reader and the snapshot build run in worker threads that share the GIL
    # with the event loop; by default a thread running Python keeps the GIL for 5 ms
    # before the loop may take it, the loop's whole budget (scripts/bench_reader.py).
    sys.setswitchinterval(0.001)
    # Among 1000 peers the agent keeps nearly every container it makes (the decoded
    # snapshots, until the peer's next version), so the default collector, a young
    # collection every 700 of them, finds little garbage and scans them again as they
    # age: 86 young and 8 middle collections in 22 s freed 321 objects for 51 ms of CPU;
    # at 10,000, 2 young ones took 15-17 ms (docs/gossip.md, The garbage collector).
    gc.set_threshold(10_000, 10, 10)
    return asyncio.run(Agent(config, args.config).run())


def _shows(path: str, renderer: Callable[[Any], str]) -> Callable[[argparse.Namespace], int]:
    """A command that GETs `path` and prints the answer, as JSON or for a person."""

    def command(args: argparse.Namespace) -> int:
        body = _query(args, path)
        # JSON is escaped by json.dumps (ensure_ascii): every control and non-ASCII character.
        print(json.dumps(body, indent=2) if args.json else renderer(render.printable(body)))
        return 0

    return command


def _posts(path: str, renderer: Callable[[Any], str]) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        with Client(_socket_path(args)) as client:
            body = client.post(path, {})
        print(json.dumps(body) if args.json else renderer(render.printable(body)))
        return 0

    return command


def _drained(body: Any) -> str:
    said = ("draining: peers stop sending new requests" if body["draining"]
            else "undrained: peers may send requests again")
    if not body["kept"]:
        said += "\nnot kept on disk: a restart forgets it (`loadmesh status` says why)"
    return said


# name, help, what it runs: the operator commands that only read or flip agent state.
CLIENT_COMMANDS: list[tuple[str, str, Callable[[argparse.Namespace], int]]] = [
    ("status", "show the running agent's status", _shows("/v1/status", render.status)),
    ("dump", "show the eBPF fingerprint maps, per model and flow",
     _shows("/v1/fingerprints", render.fingerprints)),
    ("snapshot", "show this node's current LoadSnapshot", _shows("/v1/snapshot", render.snapshot)),
    ("peers", "show the mesh as this node sees it", _shows("/v1/peers", render.peers)),
    ("drain", "stop peers from sending this node new requests", _posts("/v1/drain", _drained)),
    ("undrain", "end a drain", _posts("/v1/undrain", _drained)),
]


def cmd_best(args: argparse.Namespace) -> int:
    query = {"model": args.model}
    if args.session:
        query["session"] = args.session
    if args.exclude:
        query["exclude"] = args.exclude
    if args.dry_run:
        query["dry_run"] = "1"
    with Client(_socket_path(args)) as client:
        try:
            body = client.get("/v1/best", **query)
        except ApiError as exc:
            if exc.status != 503:
                raise
            return _fail(exc.message)
    print(json.dumps(body, indent=2) if args.json else render.best(render.printable(body)))
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    config = config_mod.load(args.file)
    refusal = config_mod.open_mesh_refusal(config.gossip)
    if refusal:
        print(f"{args.file}: {refusal}", file=sys.stderr)
        return config_mod.EXIT_CONFIG
    print(f"{args.file}: ok (node_id {config.node_id})")
    return 0


def cmd_config_defaults(_: argparse.Namespace) -> int:
    print(config_mod.defaults_toml(), end="")
    return 0


def _client_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help="the agent's API socket (default: $LOADMESH_SOCKET or "
                            f"{config_mod.ApiConfig().socket})")
    where.add_argument("--config", metavar="FILE", help="take the socket from this config file")
    parser.add_argument("--json", action="store_true", help="print the agent's JSON answer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loadmesh",
        description="Route GPU inference requests to the right peer from live, passively "
                    "measured load.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    agent = commands.add_parser("agent", help="run the agent in the foreground")
    agent.add_argument("--config", metavar="FILE",
                       help="TOML configuration (default: the embedded defaults)")
    agent.set_defaults(func=cmd_agent)

    for name, help_text, func in CLIENT_COMMANDS:
        command = commands.add_parser(name, help=help_text)
        _client_options(command)
        command.set_defaults(func=func)

    best = commands.add_parser("best", help="ask which peer should serve a request for MODEL")
    best.add_argument("model", metavar="MODEL", help='the JSON "model" of the request')
    best.add_argument("--session", metavar="S", help="session key: stick to one peer")
    best.add_argument("--exclude", metavar="IDS", help="comma-separated node ids to avoid")
    best.add_argument("--dry-run", action="store_true",
                      help="only show the answer: count no request sent (in-flight, session rates)")
    _client_options(best)
    best.set_defaults(func=cmd_best)

    cli_simulate.add_parser(commands)

    config = commands.add_parser("config", help="check a configuration file, show defaults")
    config_commands = config.add_subparsers(dest="config_command", required=True,
                                            metavar="ACTION")
    check = config_commands.add_parser("check", help="validate FILE and exit")
    check.add_argument("file", metavar="FILE")
    check.set_defaults(func=cmd_config_check)
    defaults = config_commands.add_parser("defaults", help="print every key with its default")
    defaults.set_defaults(func=cmd_config_defaults)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except config_mod.ConfigError as exc:
        return _fail(str(exc), config_mod.EXIT_CONFIG)
    except AgentUnavailable as exc:
        return _fail(str(exc))
    except ApiError as exc:
        return _fail(f"the agent refused: {exc}")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `loadmesh dump | head`: the reader left; say nothing more, like any filter.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
