"""Policy options: a bad value fails when the policy is made (or at `--set`), naming the policy, the
option and what to give, instead of running with it."""

import math

import pytest

from qosflow.cli.main import main
from qosflow.policies import get_policy


def test_tiresias_refuses_nonsense_options_on_the_command_line(capsys):
    """`--set tiresias.locality=nowhere`, a negative promote_knob and thresholds that do not increase ran
    (an unknown locality placed as if 'spread'; [7200, 10] made a queue no job stays in)."""
    for setting, said in (
        ("tiresias.locality=nowhere", "option 'locality' of policy 'tiresias' takes one of auto, consolidated, spread, any, got 'nowhere'"),
        ("tiresias.promote_knob=-3", "tiresias policy: promote_knob must be a finite number >= 0"),
        ("tiresias.thresholds=[7200,10]", "tiresias policy: thresholds must be increasing"),
        ("tiresias.thresholds=[]", "tiresias policy: thresholds must be at least one threshold"),
    ):
        rc = main(["simulate", "--trace", "synthetic", "--jobs", "5", "--cluster", "1x4", "--policies", "tiresias",
                   "--no-plots", "--set", setting])
        assert rc == 2, setting
        err = " ".join(capsys.readouterr().err.split())
        assert "invalid --set" in err and said in err, err


BAD = [
    ("tiresias", "thresholds", [3250, 3250], "increasing"),
    ("tiresias", "thresholds", [-1], "increasing"),
    ("tiresias", "thresholds", [math.nan], "increasing"),
    ("tiresias", "thresholds", [0, 10], "increasing"),
    ("tiresias", "thresholds", 3250, "a list"),
    ("tiresias", "thresholds", ["a"], "increasing"),
    ("tiresias", "thresholds", [], "at least one threshold"),
    ("tiresias", "thresholds", (), "at least one threshold"),
    ("tiresias", "promote_knob", math.nan, ">= 0"),
    ("tiresias", "promote_knob", math.inf, ">= 0"),
    ("tiresias", "promote_knob", True, ">= 0"),
    ("tiresias", "spread_tolerance", 0.5, ">= 1"),
    ("tiresias", "spread_tolerance", math.nan, ">= 1"),
    ("tiresias", "locality", 2, "one of"),
    ("fifo", "locality", "nowhere", "one of 'consolidated', 'spread', 'any'"),
    ("fifo", "backfill", "yes", "true or false"),
    ("sjf", "locality", "nowhere", "one of"),
    ("srtf", "locality", "nowhere", "one of"),
    ("sjf-ffs", "locality", "nowhere", "one of"),
    ("sjf-ffs", "sub_batch", 1, "true or false"),
    ("sjf-bsbf", "locality", None, "one of"),
    ("sjf-bsbf", "sub_batch", "no", "true or false"),
    ("gavel", "round_seconds", -1, "> 0"),
    ("gavel", "round_seconds", math.nan, "> 0"),
    ("gavel", "round_seconds", math.inf, "> 0"),
    ("gavel", "round_seconds", True, "> 0"),
    ("gavel", "tiebreak", "water", "one of 'throughput', 'none'"),
    ("gavel", "backfill", "false", "true or false"),
]


@pytest.mark.parametrize("policy,option,value,said", BAD, ids=[f"{p}.{o}={v!r}" for p, o, v, _ in BAD])
def test_every_policy_refuses_nonsense_options(policy, option, value, said):
    """(An empty list of Tiresias thresholds was accepted: one queue, i.e. FIFO with backfilling under
    Tiresias' name; the message says so and names the fifo policy.)"""
    with pytest.raises(ValueError) as info:
        get_policy(policy, **{option: value})
    msg = str(info.value)
    assert msg.startswith(f"{policy} policy: {option} must be "), msg
    assert said in msg and f"got {value!r}" in msg, msg


def test_sensible_options_still_pass():
    assert get_policy("tiresias", thresholds=[3250, 7200], promote_knob=2, locality="spread", spread_tolerance=1).thresholds == (3250.0, 7200.0)
    assert get_policy("tiresias", thresholds=(3250,), spread_tolerance=math.inf).thresholds == (3250.0,)  # spread any job
    assert get_policy("fifo", backfill=True, locality="any").locality == "any"
    assert get_policy("sjf-bsbf", sub_batch=False, locality="spread").sub_batch is False
    assert get_policy("gavel", round_seconds=60, tiebreak="none", backfill=False).round_seconds == 60.0
    assert get_policy("genie") is not None


def test_a_name_option_given_something_else_lists_its_names():
    """`--set tiresias.locality=2` said only "takes a name": now the names it takes, at `--set` as in a QoS
    policy block (`option_problem`)."""
    from qosflow.errors import SpecError
    from qosflow.policies import option_problem, parse_policy_options

    for setting, names in (("tiresias.locality=2", "auto, consolidated, spread, any"),
                           ("tiresias.locality=null", "auto, consolidated, spread, any"),
                           ("qosflow.partner_rank=2", "benefit, throughput")):
        pol, opt = setting.split("=")[0].split(".")
        with pytest.raises(SpecError, match=rf"option '{opt}' of policy '{pol}' takes one of {names}, got '"):
            parse_policy_options([setting], [pol])
    assert option_problem("tiresias", "locality", 2) == "option 'locality' of policy 'tiresias' takes one of auto, consolidated, spread, any, got 2"
    # the names themselves pass; a name not among them is refused as soon as it is read, with the same list
    assert parse_policy_options(["tiresias.locality=consolidated", "qosflow.partner_rank=benefit"], ["tiresias", "qosflow"]) == {
        "tiresias": {"locality": "consolidated"}, "qosflow": {"partner_rank": "benefit"}}
    with pytest.raises(SpecError, match="'tiresias.locality=nowhere': option 'locality' of policy 'tiresias' takes one of auto, consolidated, spread, any, got 'nowhere'"):
        parse_policy_options(["tiresias.locality=nowhere"], ["tiresias"])


def test_an_option_set_twice_is_an_error(capsys):
    """The second `--set tiresias.locality=...` won without a word; a repeat is most likely a mistake."""
    from qosflow.errors import SpecError
    from qosflow.policies import parse_policy_options

    with pytest.raises(SpecError, match=r"invalid --set: tiresias\.locality is set twice, to 'spread' and to 'any': give each option once"):
        parse_policy_options(["tiresias.locality=spread", "tiresias.promote_knob=2", "Tiresias.locality=any"], ["tiresias"])
    with pytest.raises(SpecError, match=r"qosflow\.express_share is set twice, to '0.1' and to '0.1'"):
        parse_policy_options(["qosflow.express_share=0.1", "qosflow.express_share=0.1"], ["qosflow"])
    # the same option of two policies is two options
    assert parse_policy_options(["fifo.locality=any", "sjf.locality=spread"], ["fifo", "sjf"]) == {
        "fifo": {"locality": "any"}, "sjf": {"locality": "spread"}}
    rc = main(["simulate", "--trace", "synthetic", "--jobs", "5", "--cluster", "1x4", "--policies", "gavel", "--no-plots",
               "--set", "gavel.round_seconds=60", "--set", "gavel.round_seconds=120"])
    assert rc == 2
    assert "gavel.round_seconds is set twice, to '60' and to '120'" in capsys.readouterr().err


def test_a_name_is_read_without_the_spaces_around_it():
    """`--set "fifo.locality = any"` kept the text ' any' and was refused as "takes one of consolidated, spread,
    any, got 'any'" (the value shown stripped); qosflow.partner_rank=' benefit' failed in the constructor."""
    from qosflow.policies import parse_policy_options

    assert parse_policy_options(["fifo.locality = any", "qosflow.partner_rank= benefit "], ["fifo", "qosflow"]) == {
        "fifo": {"locality": "any"}, "qosflow": {"partner_rank": "benefit"}}
