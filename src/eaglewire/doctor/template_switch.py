"""The chat template's switches (``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) the draft's
data was rendered with, against those serving renders with: a thinking / non-thinking mismatch feeds
the draft prompts unlike any it learned (an empty ``<think></think>`` block it never saw, or one it
always saw missing), a loss nothing else reports (SpecForge #296).

Training's switch is the draft contract's ``chat_template_kwargs`` (``{}``: the template's defaults;
None: not recorded). Serving's, from what the doctor is given:
  --chat-template-kwargs JSON  what serving renders every request with by default (stated by the user)
  --engine-flags               the engine's own launch default (each engine module's
                               ``launch_template_kwargs``: vLLM's and SGLang's
                               ``--default-chat-template-kwargs``, llama-server's
                               ``--chat-template-kwargs`` and ``--reasoning on|off``); flags that set
                               none render with the template's defaults
  --traffic FILE               each chat request's own ``chat_template_kwargs`` over the launch default
                               (every engine lets the request's keys win); a request that sends none,
                               with no launch default known, tells nothing
Two switches are judged alike when the target's chat template renders a probe conversation (and its
generation prompt) to the same text with both, so a key the template ignores, or one set to the
template's own default, is no mismatch; without a template, the mappings are compared.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from eaglewire import engines
from eaglewire.core.contract import (ContractError, HiddenStateContract, describe_template_kwargs, template_kwargs,
                                     template_kwargs_flags)
from eaglewire.doctor.verdicts import Check, DoctorReport

NAME = "template switch"
PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "2 + 2 = 4."},
         {"role": "user", "content": "And 3 + 3?"}]


@dataclass
class ServingSwitch:
    """What serving renders with, and where the doctor read it."""

    kwargs: dict[str, Any]
    source: str


def launch_switch(engine: str, engine_flags: str | None, chat_template_kwargs: str | None
                  ) -> tuple[ServingSwitch | None, str | None]:
    """(serving's default switch, a problem reading it): ``chat_template_kwargs`` (``--chat-template-kwargs``),
    else ``engine``'s launch flags; (None, None) when neither is given."""
    if chat_template_kwargs:
        try:
            kwargs = template_kwargs(json.loads(chat_template_kwargs))
        except (ValueError, ContractError) as e:
            return None, f"--chat-template-kwargs {chat_template_kwargs!r}: {e}"
        return ServingSwitch(kwargs, "--chat-template-kwargs"), None
    lint = engines.get(engine).linter
    if not engine_flags or lint is None or lint.launch_template_kwargs is None:
        return None, None
    try:
        found = lint.launch_template_kwargs(engine_flags)
    except ValueError as e:
        return None, f"--engine-flags: {e}"
    where = f"{engine}'s launch flags ({lint.template_kwargs_flag})" if found is not None else \
        f"{engine}'s launch flags, which set no {lint.template_kwargs_flag}"
    return ServingSwitch(template_kwargs(found or {}), where), None


def traffic_switches(prompts: list[Any], launch: ServingSwitch | None) -> list[ServingSwitch]:
    """The switches the chat requests of the traffic render with (their own keys over the launch
    default), one per distinct switch with its request count; requests that tell nothing are left out."""
    chat = [p for p in prompts if p.messages is not None]
    known = [{**(launch.kwargs if launch else {}), **(p.template_kwargs or {})} for p in chat
             if p.template_kwargs is not None or launch is not None]
    counts = Counter(json.dumps(k, sort_keys=True) for k in known)
    return [ServingSwitch(json.loads(k), f"{n} of {len(chat)} traffic chat request(s)")
            for k, n in counts.most_common()]


def renders_alike(tokenizer: Any, a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether the chat template renders the probe (whole, and its generation prompt) alike with ``a``
    and ``b``; the mappings compared where there is no template to render."""
    if a == b:
        return True
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False

    def render(kwargs: dict[str, Any]) -> tuple[str, str]:
        return tuple(tokenizer.apply_chat_template(PROBE[:n], tokenize=False, add_generation_prompt=gen, **kwargs)
                     for n, gen in ((3, False), (4, True)))

    try:
        return render(a) == render(b)
    except Exception:  # a template that refuses a key (raise_exception) renders differently by definition
        return False


def _fix(engine: str, trained: dict[str, Any], serving: dict[str, Any], traffic: bool) -> str:
    lint = engines.get(engine).linter
    if lint is not None and lint.template_kwargs_fix is not None:
        launch = f"launch {engine} with {lint.template_kwargs_fix(trained)}"
    else:
        launch = f"serve with chat_template_kwargs {json.dumps(trained, sort_keys=True)}"
    requests = (f"; requests that send chat_template_kwargs override it: send {json.dumps(trained, sort_keys=True)}"
                " or none" if traffic else "")
    return (f"{launch}{requests}; or prepare the data with {template_kwargs_flags(serving)} and retrain "
            "(the draft then learns what serving renders)")


def check_template_switch(report: DoctorReport, contract: HiddenStateContract, tokenizer: Any,
                          traffic: list[Any] | None = None, *, engine: str, engine_flags: str | None,
                          chat_template_kwargs: str | None) -> Check | None:
    """Training's chat-template switch against serving's (``launch_switch``: the flags' or
    ``chat_template_kwargs``, and the ``traffic`` requests'), where serving's can be known (see the module's
    text); None (no check) when the doctor was given nothing that says how serving renders."""
    launch, problem = launch_switch(engine, engine_flags, chat_template_kwargs)
    if problem:
        return report.add(Check(NAME, "fail", f"cannot read serving's chat template switch: {problem}",
                                fix='give a JSON object, e.g. \'{"enable_thinking": false}\''))
    switches = ([launch] if launch else []) + traffic_switches(traffic or [], launch)
    if not switches:
        if traffic:
            return report.add(Check(NAME, "skip", "no traffic request sends chat_template_kwargs and serving's "
                                    "launch default is unknown", fix="pass --chat-template-kwargs JSON (what "
                                    "serving renders with) or the engine's launch flags (--engine-flags)"))
        return None
    trained = contract.chat_template_kwargs
    evidence = [f"serving: {describe_template_kwargs(s.kwargs)} ({s.source})" for s in switches]
    if trained is None:
        return report.add(Check(NAME, "skip", "the draft records no chat template switch (trained before "
                                "eaglewire recorded it, or imported), so serving's cannot be compared", evidence,
                                fix="prepare and train with this eaglewire to have it checked"))
    evidence.insert(0, f"training: the data was rendered with {describe_template_kwargs(trained)}")
    other = [s for s in switches if not renders_alike(tokenizer, trained, s.kwargs)]
    if not other:
        return report.add(Check(NAME, "ok", "serving renders the chat template as training did", evidence))
    first = other[0]
    return report.add(Check(
        NAME, "fail", f"serving renders the chat template with {describe_template_kwargs(first.kwargs)} "
        f"({first.source}) but the draft was trained on data rendered with {describe_template_kwargs(trained)}: "
        "it is fed prompts unlike any it learned (a thinking block it never saw, or one it always saw missing)",
        evidence, fix=_fix(engine, trained, first.kwargs, bool(traffic))))
