"""State diagrams of every lifecycle spec, for audit: Mermaid (drawn by transitions'
GraphMachine with its mermaid engine, no system binary) and DOT (written from the spec, so no
graphviz package is needed), and a spec's decision table in Markdown (the walk's policy). All
are checked in under specs/diagrams/, which the manual (docs/) embeds as they are; `--check` fails
when they no longer match the specs."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from relayline.machines.engine import SPEC_NAMES, Spec, load_spec, machine_kwargs

HEADER = "generated from specs/{name}.toml by `relayline diagram`; do not edit"


def mermaid(spec: Spec) -> str:
    from transitions.extensions.diagrams import GraphMachine

    class Model:
        pass

    machine = GraphMachine(model=Model(), graph_engine="mermaid", show_conditions=True,
                           title=spec.name,
                           **machine_kwargs(spec))
    text = machine.models[0].get_graph().draw(None)
    assert text is not None  # (drawn to no file, the diagram comes back as text)
    # keep the graph, drop the front matter and the "current state" styling (a spec has none)
    body = text[text.index("stateDiagram-v2"):].splitlines()[1:]
    body = [
        line
        for line in body
        if line.strip() and not line.strip().startswith(("classDef", "Class "))
    ]
    notes = [f"  %% {HEADER.format(name=spec.name)}"]
    notes += [f"  %% {s.name}: {', '.join(sorted(s.tags))}" for s in spec.states.values() if s.tags]
    entries = [
        f"  {s.name} : entry / {', '.join(s.enter)}" for s in spec.states.values() if s.enter
    ]
    return "\n".join(["stateDiagram-v2", *notes, *body, *entries]) + "\n"


def dot(spec: Spec) -> str:
    lines = [f"// {HEADER.format(name=spec.name)}", f'digraph "{spec.name}" {{', "  rankdir=LR;",
             '  node [shape=box, style=rounded, fontname="Helvetica"];',
             '  "__start" [shape=point];',
             f'  "__start" -> "{spec.initial}";']
    for state in spec.states.values():
        attrs = []
        if "terminal" in state.tags:
            attrs.append("peripheries=2")
        if "immutable_output" in state.tags:
            attrs.append('style="rounded,filled", fillcolor="#fde2c8"')
        elif "provider_call" in state.tags:
            attrs.append('style="rounded,filled", fillcolor="#d8e8fb"')
        label = state.name + (f"\\n[{', '.join(sorted(state.tags))}]" if state.tags else "")
        label += f"\\nentry / {', '.join(state.enter)}" if state.enter else ""
        attrs.append(f'label="{label}"')
        lines.append(f'  "{state.name}" [{", ".join(attrs)}];')
    for t in spec.transitions:
        conds = [*t.guards, *(f"!{u}" for u in t.unless)]
        label = t.trigger + (f" [{' & '.join(conds)}]" if conds else "")
        for source in t.sources:
            lines.append(f'  "{source}" -> "{t.dest}" [label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _conditions(pairs: tuple[tuple[str, bool], ...]) -> str:
    return ", ".join(name if value else f"not {name}" for name, value in pairs)


def decision_table(spec: Spec) -> str:
    """The spec's decision table in Markdown: one row per decision, then what each situation,
    wait and action means. Rows are unordered: exactly one matches any failure and situation."""
    table = spec.decisions
    assert table is not None
    lines = [f"<!-- {HEADER.format(name=spec.name)} -->",
             f"A failed attempt in `{table.state}` fires the trigger of the one row that matches "
             "its failure "
             "class: every `when` situation holds and not all of `unless` hold (checked at load: "
             "every class "
             "under every combination of situations is decided by exactly one row).", "",
             "| failure | when | unless | fires | wait | actions |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in table.rows:
        cells = [", ".join(row.failures), _conditions(row.when) or "always",
                 _conditions(row.unless),
                 f"`{row.then}`", row.wait or "", ", ".join(row.actions)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for title, docs in (("situation", table.situations), ("wait", table.waits),
                        ("action", table.actions)):
        lines += [f"- {title} `{name}`: {doc}" for name, doc in docs.items()]
    return "\n".join(lines) + "\n"


def outcome_tables(spec: Spec) -> str:
    """The spec's outcome tables in Markdown: for each, one row per value given, then what each
    situation it reads means. Rows are unordered: exactly one matches any situation."""
    lines = [f"<!-- {HEADER.format(name=spec.name)} -->"]
    for table in spec.outcomes.values():
        lines += ["",
                  f"`{table.name}`: {table.doc} (checked at load: under every combination of the "
                  "situations it "
                      "reads, exactly one row gives a value).", "",
                  "| when | unless | gives | why |", "| --- | --- | --- | --- |"]
        lines += [f"| {_conditions(row.when) or 'always'} | {_conditions(row.unless)} | "
                  f"`{row.gives}` | {row.doc} |"
                  for row in table.rows]
        lines.append("")
        lines += [
            f"- situation `{name}`: {spec.guards[name]}"
            for name in table.reads
            if name in spec.guards
        ]
    return "\n".join(lines) + "\n"


def precedence_tables(spec: Spec) -> str:
    """The spec's precedence tables in Markdown: for each, its sources in the order they are
    asked (the first that gives a value decides; the last always gives one)."""
    lines = [f"<!-- {HEADER.format(name=spec.name)} -->"]
    for table in spec.precedence.values():
        lines += ["", f"`{table.name}`: {table.doc} (checked at load: each source named once, "
                      "the last the only one that always gives a value).", "",
                  "| order | source | gives |", "| --- | --- | --- |"]
        lines += [f"| {i} | `{source.name}`{' (always)' if source.always else ''} | {source.doc} |"
                  for i, source in enumerate(table.sources, start=1)]
    return "\n".join(lines) + "\n"


def default_root() -> Path:
    return Path(str(resources.files("relayline.specs"))) / "diagrams"


def render() -> dict[str, str]:
    out = {}
    for name in SPEC_NAMES:
        spec = load_spec(name)
        out[f"{name}.mmd"] = mermaid(spec)
        out[f"{name}.dot"] = dot(spec)
        if spec.decisions is not None:
            out[f"{name}-decisions.md"] = decision_table(spec)
        if spec.outcomes:
            out[f"{name}-outcomes.md"] = outcome_tables(spec)
        if spec.precedence:
            out[f"{name}-precedence.md"] = precedence_tables(spec)
    return out


def _outputs(root: Path) -> dict[Path, str]:
    return {root / name: text for name, text in render().items()}


def write(root: Path | None = None) -> list[Path]:
    root = root or default_root()
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in _outputs(root).items():
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def check(root: Path | None = None) -> list[str]:
    """The diagram files that are missing or differ from the specs now."""
    root = root or default_root()
    return [path.name for path, text in _outputs(root).items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]
