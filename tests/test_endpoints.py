"""The local API's one table: every endpoint in it reaches a handler, once, and README's
table lists the same ones."""

from __future__ import annotations

import re
from pathlib import Path

from loadmesh.daemon.agent import Agent
from loadmesh.daemon.config import Config
from loadmesh.daemon.endpoints import endpoints

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_table_matches_the_readme_and_names_no_endpoint_twice(run_dir: Path) -> None:
    routes = endpoints(Agent(Config(node_id="n0", state_dir=str(run_dir))))
    served = [(r.method, r.path) for r in routes]
    assert len(set(served)) == len(served)
    assert all(callable(r.handler) and r.answers for r in routes)
    section = README.read_text().split("## The local API", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"`(GET|POST) (/[^`?\s]*)", section)
    assert sorted(documented) == sorted(served)
