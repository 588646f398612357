"""Whether a run's results were made from the outputs and settings its report shows beside them.

Outputs: evaluate's manifest records the digest of each upstream output it read, and each of those manifests its own
inputs' digests. Followed up the stage graph from evaluate, every output there now that is not the one recorded is
named (made again, removed, unreadable); the outputs above it cannot be checked, as the records that named them went
with it.

Settings: each evaluated stage this rlaif build made has its cache key recomputed from config.yaml's settings now,
with the inputs its manifest recorded and each value the computing switches can take, by the function the stages
key with (rlaif.config.stage_config_hash); another build's keys are not recomputed (its schema may key other
fields). Where none gives the config_hash it recorded, config.yaml holds other settings for that stage than it ran
with (edited by hand, or a stage launched since with other settings). Files the config names are keyed by their
content, which the manifest recorded: a path changed to a file of the same content is the same setting, and a path
changed to another file is not seen here. A config section counts as changed where a stage keyed on it differs and
no stage keyed on it matches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlaif.config import parse_config, possible_switches, stage_config_hash
from rlaif.errors import UserError, one_line
from rlaif.graph import STAGE_BY_NAME, STAGES, topological_order
from rlaif.io.digest import code_digest
from rlaif.stages.common import content_keyed_fields

ROOT = "evaluate"  # the stage whose results a report shows


@dataclass
class Lineage:
    replaced: dict[str, str] = field(default_factory=dict)  # stage -> what became of the output the results used
    unchecked: list[str] = field(default_factory=list)  # stages above a replaced output: no record left to match
    settings_changed: list[str] = field(default_factory=list)  # evaluated stages whose config.yaml settings differ
    sections_changed: set[str] = field(default_factory=set)  # config sections only those stages key
    # why config.yaml was not (wholly) compared with the stages' keys; "" when it was, None without evaluate's manifest
    settings_unread: str | None = None

    def evaluated(self, stage: str) -> bool:
        """The output of `stage` there now is the one the results were made from (as far as the records tell)."""
        return stage not in self.replaced and stage not in self.unchecked

    def caveat(self, stages: tuple[str, ...] = (), sections: tuple[str, ...] = ()) -> str:
        """The mark of a value read from the outputs of `stages` or from config.yaml's `sections`, where it may not
        be what the results were made from; "" where it is."""
        other = [stage for stage in stages if not self.evaluated(stage)]
        if other:
            whose = "outputs'" if len(other) > 1 else "output's"
            return f" ⚠ may not be the evaluated {listed(other)} {whose}"
        if self.sections_changed & set(sections):
            return " ⚠ config.yaml now, not what the evaluated stages ran with"
        return ""

    def notes(self) -> list[str]:
        """One line per output the results were not made from, and one where config.yaml's settings changed."""
        out = []
        order = [stage.name for stage in topological_order()]
        for stage in [name for name in order if name in self.replaced]:
            above = [name for name in order if name in self.unchecked and name in upstream(stage)]
            unknown = "" if not above else (
                f"; whether the {listed(above)} outputs above it are the ones behind them cannot be told"
                if len(above) > 1 else f"; whether the {above[0]} output above it is the one behind them cannot be "
                                       "told")
            out.append(f"These results were made from an earlier {stage} output of this run, since "
                       f"{self.replaced[stage]}: what this report shows of it (statistics, curves, settings) may "
                       f"not be what they were made from{unknown}. Re-run the pipeline to update them.")
        if self.settings_changed:
            out.append(f"config.yaml no longer holds the settings {', '.join(self.settings_changed)} ran with (edited "
                       "by hand, or a stage launched with other settings since): settings marked ⚠ may not be the "
                       "ones these results were made with. Re-run the pipeline to update them.")
        return out


def listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def upstream(stage: str) -> list[str]:
    """Every stage whose output `stage` reads, directly or through others (the stage graph's inputs)."""
    found, todo = [], list(STAGE_BY_NAME[stage].inputs)
    while todo:
        name = todo.pop()
        if name not in found:
            found.append(name)
            todo += STAGE_BY_NAME[name].inputs
    return found


def trace(manifests: dict[str, dict | None], problems: dict[str, tuple[str, str]],
          config_text: bytes | None) -> Lineage:
    """The lineage of the results in a run whose manifests (None: absent or unreadable, `problems` says why) and
    config.yaml are these. Without evaluate's manifest nothing can be checked: an empty Lineage (the report says so
    on its own)."""
    if manifests.get(ROOT) is None:
        return Lineage()
    replaced, unchecked, matched = _outputs(manifests, problems)
    lineage = Lineage(replaced, unchecked, settings_unread="")
    _compare_settings(lineage, {s.name: manifests[s.name] for s in topological_order() if s.name in matched},
                      config_text)
    return lineage


def _outputs(manifests: dict[str, dict | None],
             problems: dict[str, tuple[str, str]]) -> tuple[dict[str, str], list[str], set[str]]:
    """Each upstream output there now that is not the one recorded by its evaluated readers, the stages above those
    (their readers' records went with them), and the stages whose output is the recorded one. Readers that record
    nothing for a stage (hand-made manifests) leave it unchecked and unflagged, as they leave the stages above it."""
    replaced, unchecked, matched = {}, [], {ROOT}
    above = upstream(ROOT)
    for stage in reversed(topological_order()):  # every stage after each stage that reads it
        name = stage.name
        if name not in above:
            continue
        readers = [s.name for s in STAGES if name in s.inputs]
        recorded = {(manifests[r].get("inputs") or {}).get(name) for r in readers if r in matched} - {None}
        now = manifests.get(name)
        if not recorded:
            if any(r in replaced or r in unchecked for r in readers):
                unchecked.append(name)
        elif now is None:
            replaced[name] = (f"unreadable (its manifest {problems[name][0]})" if name in problems
                              else "removed (a re-run that did not finish?)")
        elif recorded != {now.get("digest")}:
            replaced[name] = "made again"
        else:
            matched.add(name)
    return replaced, unchecked, matched


def _compare_settings(lineage: Lineage, committed: dict[str, dict], config_text: bytes | None) -> None:
    if config_text is None:
        lineage.settings_unread = "the run has no config.yaml"
        return
    try:
        cfg = parse_config(config_text.decode("utf-8"), "config.yaml")
    except (UserError, UnicodeDecodeError) as exc:
        lineage.settings_unread = f"config.yaml does not load with this rlaif ({one_line(exc, 160)})"
        return
    # A key recomputed by another build's schema (its fields, defaults, runtime fields) would differ for the same
    # config.yaml: only the stages this rlaif's code made are compared.
    ours = code_digest()
    compared = {name: _keyed_alike(cfg, name, m) for name, m in committed.items() if m.get("code_digest") == ours}
    if len(compared) < len(committed):
        other = [name for name in committed if name not in compared]
        lineage.settings_unread = (f"{', '.join(other)} {'was' if len(other) == 1 else 'were'} made by another "
                                   "rlaif build, whose cache keys this one cannot recompute")
    lineage.settings_changed = [name for name, same in compared.items() if not same]
    keyed = {name: set(STAGE_BY_NAME[name].config_sections) for name in compared}
    lineage.sections_changed = (set().union(*(keyed[name] for name in lineage.settings_changed))
                                - set().union(*(keyed[name] for name, same in compared.items() if same)))


def _keyed_alike(cfg, name: str, committed: dict) -> bool:
    """Does config.yaml's config give the stage's recorded cache key, with its recorded inputs?"""
    sections = STAGE_BY_NAME[name].config_sections
    by_content = content_keyed_fields(cfg, name)
    return any(stage_config_hash(cfg, sections, committed.get("inputs") or {}, by_content,
                                 switches=switches) == committed.get("config_hash")
               for switches in possible_switches(sections))
