"""Pipeline schedules: orders, dependencies, activation memory, and the closed-form bubbles."""

from __future__ import annotations

import doctest
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parsim.schedules
from parsim.errors import ParsimError
from parsim.report.trace import compute_name
from parsim.schedules import (SCHEDULES, Action, Schedule, ScheduleError, closed_form, dependencies, in_flight_by_stage,
                              make_schedule, peak_in_flight, simulate_ideal, splits_into_rounds, validate)

FAST = settings(max_examples=60, deadline=None)
times = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])


@st.composite
def schedules(draw, names=tuple(SCHEDULES)):
    """Any valid (name, pp, m, v) with pp in 1..8 and m in 1..16, respecting each schedule's constraints."""
    name = draw(st.sampled_from(names))
    pp = draw(st.integers(1, 8))
    low, high = SCHEDULES[name].virtual_stages
    v = draw(st.integers(low, high or 3))
    m = draw(st.integers(1, 16))
    if SCHEDULES[name].needs_whole_rounds(v):
        m = m if splits_into_rounds(pp, m) else pp * max(1, m // pp)
    m = max(m, SCHEDULES[name].min_microbatches(pp, v))
    return make_schedule(name, pp, m, v)


# --- the orders, as the papers draw them -----------------------------------------------------------


def test_1f1b_is_warmup_steady_cooldown():
    s = make_schedule("1f1b", 4, 8)
    assert s.format() == "\n".join([
        "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "rank 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "rank 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ])


def test_gpipe_runs_all_forwards_then_all_backwards():
    s = make_schedule("gpipe", 2, 3)
    assert s.format() == "rank 0: F0 F1 F2 B0 B1 B2\nrank 1: F0 F1 F2 B0 B1 B2"


def test_zero_bubble_rank_r_defers_r_weight_passes_to_the_tail():
    s = make_schedule("zero-bubble", 4, 8)
    assert str(s.format().splitlines()[0]) == (
        "rank 0: F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7")
    assert s.format().splitlines()[3] == (
        "rank 3: F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7")


def test_interleaved_places_stage_s_on_rank_s_mod_pp_and_goes_depth_first():
    s = make_schedule("interleaved-1f1b", 2, 4, 2)
    assert [s.stage_to_rank(x) for x in range(4)] == [0, 1, 0, 1]
    assert s.stages_of(1) == [1, 3]
    # rank 0 warms up with (v-1)pp + 2(pp-1) = 4 forwards: microbatches 0,1 on stage 0, then on stage 2
    assert [a.torch_str() for a in s.actions[0][:4]] == ["0F0", "0F1", "2F0", "2F1"]


def test_zbv_places_stages_in_a_v():
    s = make_schedule("zbv", 4, 8)
    assert [s.stage_to_rank(x) for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert s.stages_of(0) == [0, 7]


# --- dependencies and deadlocks -------------------------------------------------------------------


def test_dependencies_follow_the_data():
    s = make_schedule("zero-bubble", 3, 3)
    assert dependencies(s, Action("F", 1, 2)) == [Action("F", 0, 2)]
    assert dependencies(s, Action("I", 1, 2)) == [Action("F", 1, 2), Action("I", 2, 2)]
    assert dependencies(s, Action("I", 2, 0)) == [Action("F", 2, 0)]  # the last stage starts from the loss
    assert dependencies(s, Action("W", 0, 1)) == [Action("I", 0, 1)]
    assert dependencies(make_schedule("1f1b", 3, 3), Action("B", 0, 0)) == [Action("F", 0, 0), Action("B", 1, 0)]


@FAST
@given(schedules())
def test_no_schedule_deadlocks_and_every_pass_runs_exactly_once(s):
    validate(s)
    counts = Counter(a for acts in s.actions for a in acts)
    def kinds(stage: int, mb: int) -> tuple[str, ...]:  # DualPipe-V splits the backwards of its last pairs only
        split = s.name in ("zero-bubble", "zb-h2", "zbv") or (s.name == "dualpipe-v" and (stage, mb) in s.split_passes)
        return ("F", "I", "W") if split else ("F", "B")

    expected = {Action(k, st_, mb) for st_ in range(s.num_stages) for mb in range(s.num_microbatches)
                for k in kinds(st_, mb)}
    assert set(counts) == expected and set(counts.values()) == {1}
    assert all(s.stage_to_rank(a.stage) == r for r, acts in enumerate(s.actions) for a in acts)


def test_a_deadlock_is_reported_with_what_each_rank_waits_for():
    s = Schedule("bad", 2, 1, 1, [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]])
    with pytest.raises(ScheduleError, match=r"deadlocks: rank 0 at B stage=0 mb=0 waits for F stage=0 mb=0"):
        validate(s)


def test_missing_and_misplaced_passes_are_reported():
    missing = Schedule("bad", 2, 1, 1, [[Action("F", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]])
    with pytest.raises(ScheduleError, match="B stage=0 mb=0 appears 0 times"):
        validate(missing)
    misplaced = Schedule("bad", 2, 1, 1, [[Action("F", 1, 0)], []])
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(misplaced)


# --- activation memory ----------------------------------------------------------------------------


@FAST
@given(st.integers(1, 8), st.integers(1, 16))
def test_peak_in_flight_is_pp_minus_r_for_1f1b_and_zb_h1_and_m_for_gpipe(pp, m):
    one_f_one_b = [min(pp - r, m) for r in range(pp)]
    assert peak_in_flight(make_schedule("1f1b", pp, m)) == one_f_one_b
    assert peak_in_flight(make_schedule("zero-bubble", pp, m)) == one_f_one_b
    assert peak_in_flight(make_schedule("gpipe", pp, m)) == [m] * pp


@FAST
@given(st.integers(1, 8), st.integers(1, 24))
def test_zb_h2_holds_twice_the_warmup_of_1f1b(pp, m):
    """Rank r keeps 2(p-r)-1 microbatches in flight (Qi et al. 2023: ZB-H2 peaks at about 2p on rank 0)."""
    assert peak_in_flight(make_schedule("zb-h2", pp, m)) == [min(2 * (pp - r) - 1, m) for r in range(pp)]


@FAST
@given(st.integers(1, 8), st.integers(1, 4), st.integers(2, 4))
def test_peak_in_flight_of_interleaved_is_its_warmup_plus_one(pp, rounds, v):
    m = pp * rounds
    expected = [min(v * m, (v - 1) * pp + 2 * (pp - 1 - r) + 1) for r in range(pp)]
    assert peak_in_flight(make_schedule("interleaved-1f1b", pp, m, v)) == expected


@FAST
@given(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b", "zbv", "dualpipe-v", "zb-h2"]), st.integers(2, 6),
       st.integers(1, 3))
def test_in_flight_by_stage_holds_every_peak_of_what_a_rank_keeps(name, pp, rounds):
    """Whatever each stage saves, and keeps while a deferred W waits, a rank's activation peak is the largest
    weighted sum over the kept moments: checked against a walk through its actions with random weights, and
    the in-flight counts' own peak is among them."""
    v = 2 if name in ("interleaved-1f1b", "zbv", "dualpipe-v") else 1
    schedule = make_schedule(name, pp, 2 * pp * rounds, v)
    rng = random.Random(pp * 100 + rounds)
    for rank, (moments, acts) in enumerate(zip(in_flight_by_stage(schedule), schedule.actions)):
        stages = schedule.stages_of(rank)
        assert all(len(m) == 2 * len(stages) for m in moments)
        assert max(sum(m[:len(stages)]) for m in moments) == peak_in_flight(schedule)[rank]
        for _ in range(3):
            saved = {s: rng.uniform(1.0, 5.0) for s in stages}
            waiting = {s: rng.uniform(0.5, 1.0) * saved[s] for s in stages}
            change = {"F": lambda s: saved[s], "B": lambda s: -saved[s], "I": lambda s: waiting[s] - saved[s],
                      "W": lambda s: -waiting[s]}
            live = peak = 0.0
            for a in acts:
                live += change[a.kind](a.stage)
                peak = max(peak, live)
            weights = [saved[s] for s in stages] + [waiting[s] for s in stages]
            best = max(sum(n * w for n, w in zip(m, weights)) for m in moments)
            assert best == pytest.approx(peak)


def test_zero_bubble_s_deferred_weight_gradients_keep_the_later_ranks_as_full_as_the_first():
    """ZB-H1 defers W: rank r holds pp - r forwards awaiting their I and r microbatches awaiting their W, which
    keep nearly all of B's memory (Qi et al. 2023, table 1), so every rank peaks near pp microbatches' worth."""
    moments = in_flight_by_stage(make_schedule("zero-bubble", 4, 8))
    assert [max(m, key=sum) for m in moments] == [(4, 0), (3, 1), (2, 2), (1, 3)]


def test_dualpipe_v_s_first_rank_peaks_with_one_microbatch_of_its_last_stage():
    """DualPipe-V's rank 0 holds stage 0 and the last stage, whose backward follows its forward at once: at its
    peak 32 of the first stage's microbatches and one of the last's, not 33 of the larger one's (its head)."""
    assert in_flight_by_stage(make_schedule("dualpipe-v", 16, 120, 2))[0] == [(32, 1, 0, 0)]


@FAST
@given(st.integers(1, 8), st.integers(0, 8))
def test_zbv_holds_1f1b_first_rank_activations_on_every_rank(pp, extra):
    """2pp half-size chunks = pp full-stage microbatches, on every rank (Qi et al. 2023, section 6)."""
    m = 2 * pp - 1 + extra
    assert peak_in_flight(make_schedule("zbv", pp, m)) == [2 * pp] * pp


# --- ideal timing and the closed forms ------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 4), (4, 8), (4, 2), (8, 16), (3, 7)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    t = simulate_ideal(make_schedule(name, pp, m), t_f=1.0, t_b=2.0)
    assert t.idle == pytest.approx([(pp - 1) * 3.0] * pp)  # (p-1)(t_f + t_b) on every rank
    assert t.step_time == pytest.approx((m + pp - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert t.bubble_fractions == pytest.approx([(pp - 1) / (m + pp - 1)] * pp)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (8, 16, 2), (3, 9, 4)])
def test_interleaving_divides_the_bubble_by_v(pp, m, v):
    t = simulate_ideal(make_schedule("interleaved-1f1b", pp, m, v), t_f=1.0 / v, t_b=2.0 / v)
    assert t.idle == pytest.approx([(pp - 1) * 3.0 / v] * pp)
    assert t.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 4), (8, 16), (3, 7)])
def test_zb_h1_bubble_is_p_minus_1_times_tf_plus_ti_minus_tw(pp, m):
    t = simulate_ideal(make_schedule("zero-bubble", pp, m), t_f=1.0, t_b=2.0, t_w=1.0)  # t_f = t_i = t_w
    assert t.idle == pytest.approx([(pp - 1) * (1.0 + 1.0 - 1.0)] * pp)  # a third of 1F1B's (p-1)(1 + 2)
    one_f_one_b = simulate_ideal(make_schedule("1f1b", pp, m), t_f=1.0, t_b=2.0)
    assert sum(t.idle) == pytest.approx(sum(one_f_one_b.idle) / 3)


@pytest.mark.parametrize("pp,m", [(2, 4), (3, 6), (4, 8), (8, 16), (3, 11)])
def test_zb_h2_works_each_rank_without_a_gap_a_parallelogram(pp, m):
    """With t_F = t_I = t_W and m >= 2p each rank r is busy over exactly [r, r + 3m]: no gap at all."""
    t = simulate_ideal(make_schedule("zb-h2", pp, m), t_f=1.0, t_b=2.0, t_w=1.0)
    for r, intervals in enumerate(t.intervals):
        assert (intervals[0].start, intervals[-1].end) == pytest.approx((r, r + 3 * m))
    assert t.idle == pytest.approx([pp - 1.0] * pp)  # only the slanted ends, (p-1) t_f


def test_zb_h2_beats_zb_h1_when_the_input_gradient_is_slow():
    """t_I = 2 t_W: ZB-H1 idles (p-1)(t_f + t_i - t_w), ZB-H2 only the ends (p-1) t_f."""
    times = dict(t_f=1.0, t_b=3.0, t_w=1.0)
    h1 = simulate_ideal(make_schedule("zero-bubble", 4, 8), **times)
    h2 = simulate_ideal(make_schedule("zb-h2", 4, 8), **times)
    assert h1.idle == pytest.approx([6.0] * 4) and h2.idle == pytest.approx([3.0] * 4)


@settings(max_examples=150, deadline=None)
@given(schedules(), times, times, st.floats(0, 1))
def test_closed_forms_match_the_simulation_whenever_they_apply(s, t_f, t_b, w_share):
    t_w = t_b * w_share if s.split_backward else 0.0
    form = closed_form(s, t_f, t_b, t_w)
    if form is None:
        return
    t = simulate_ideal(s, t_f, t_b, t_w)
    assert t.idle == pytest.approx([form.bubble_time] * s.pp)
    assert t.step_time == pytest.approx(form.step_time)
    assert t.bubble_fraction == pytest.approx(form.bubble_fraction)


def test_zb_h1_has_a_closed_form_only_where_it_holds():
    zb = make_schedule("zero-bubble", 4, 8)
    assert closed_form(zb, 1, 2, 1) is not None
    assert closed_form(zb, 1, 3, 2) is None  # t_w > t_f
    assert closed_form(make_schedule("zero-bubble", 4, 3), 1, 2, 1) is None  # m < p
    assert closed_form(make_schedule("zbv", 4, 8), 1, 2, 1) is None


def test_zb_h2_has_a_closed_form_only_where_it_holds():
    assert closed_form(make_schedule("zb-h2", 4, 7), 1, 2, 1).bubble_substituted == "(4-1) 1 = 3"
    assert closed_form(make_schedule("zb-h2", 4, 6), 1, 2, 1) is None  # m < 2p - 1
    assert closed_form(make_schedule("zb-h2", 4, 8), 1, 3, 1) is None  # t_i > t_w


def test_interleaved_with_fewer_microbatches_than_ranks_idles_at_every_turn():
    """pp 4, m 3, v 2 (one round of 3, as torch runs it): microbatch 0 is back at rank 0 after 4 passes, not 3."""
    s = make_schedule("interleaved-1f1b", 4, 3, 2)
    form = closed_form(s, 1, 2)
    assert form.bubble_substituted == "((2-1)(4-3) + 4-1)(1 + 2) = 12"
    assert simulate_ideal(s, 1, 2).step_time == pytest.approx(form.step_time) == 2 * 3 * 3 + 12
    assert closed_form(make_schedule("interleaved-1f1b", 4, 10, 2), 1, 2).bubble_time == 9  # 2 rounds of 5


def test_closed_form_substitutes_the_numbers():
    form = closed_form(make_schedule("1f1b", 4, 8), 1, 2)
    assert form.bubble_substituted == "(4-1)(1 + 2) = 9"
    assert form.fraction_substituted == "(4-1)/(8+4-1) = 3/11 = 0.2727"


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 8), st.integers(0, 4), times)
def test_zbv_with_equal_chunk_times_idles_p_minus_1_passes_per_rank(pp, extra, t):
    """Measured, not a published formula: with t_F = t_I = t_W = t per chunk, one sixth of 1F1B's bubble."""
    timing = simulate_ideal(make_schedule("zbv", pp, 2 * pp - 1 + extra), t, 2 * t, t)
    assert timing.idle == pytest.approx([(pp - 1) * t] * pp)


@FAST
@given(st.integers(1, 8), st.integers(1, 15), times, times)
def test_more_microbatches_never_grow_the_1f1b_bubble_fraction(pp, m, t_f, t_b):
    fewer = simulate_ideal(make_schedule("1f1b", pp, m), t_f, t_b).bubble_fraction
    more = simulate_ideal(make_schedule("1f1b", pp, m + 1), t_f, t_b).bubble_fraction
    assert more <= fewer + 1e-12


@pytest.mark.parametrize("pp,m,c", [(4, 8, 0.5), (2, 4, 1.0), (3, 2, 3.0)])
def test_gpipe_pays_one_transfer_per_hop_down_and_up(pp, m, c):
    t = simulate_ideal(make_schedule("gpipe", pp, m), 1.0, 2.0, t_comm=c)
    assert t.step_time == pytest.approx((m + pp - 1) * 3.0 + 2 * (pp - 1) * c)


@FAST
@given(schedules(), times, times, st.sampled_from([0.0, 0.5]))
def test_passes_start_after_their_dependencies_and_never_overlap_on_a_rank(s, t_f, t_b, t_comm):
    t = simulate_ideal(s, t_f, t_b, t_b / 2 if s.split_backward else 0.0, t_comm)
    end = {iv.action: iv.end for ivs in t.intervals for iv in ivs}
    for rank, ivs in enumerate(t.intervals):
        assert [iv.action for iv in ivs] == s.actions[rank]
        for before, after in zip(ivs, ivs[1:]):
            assert after.start >= before.end - 1e-9
        for iv in ivs:
            for dep in dependencies(s, iv.action):
                hop = t_comm if s.stage_to_rank(dep.stage) != rank else 0.0
                assert iv.start >= end[dep] + hop - 1e-9


def test_per_stage_times_let_a_slow_stage_set_the_pace():
    s = make_schedule("1f1b", 4, 16)
    t = simulate_ideal(s, t_f=[1, 1, 2, 1], t_b=[2, 2, 4, 2])
    assert t.step_time >= 16 * 6  # the slow stage is busy for m (t_f + t_b)
    assert max(t.bubble_fractions) == max(t.bubble_fractions[r] for r in (0, 1, 3))


def test_bad_times_are_one_line_errors():
    s = make_schedule("zero-bubble", 2, 2)
    with pytest.raises(ParsimError, match=r"t_w \(3\) .* cannot exceed t_b \(2\)"):
        simulate_ideal(s, 1, 2, 3)
    with pytest.raises(ParsimError, match="t_f needs one time per stage: 2 values, got 3"):
        simulate_ideal(s, [1, 1, 1], 2)
    with pytest.raises(ParsimError, match="t_b must be >= 0"):
        simulate_ideal(s, 1, -2)
    with pytest.raises(ParsimError, match="all pass times are zero"):
        simulate_ideal(s, 0, 0)


def test_the_timing_is_also_a_trace_named_like_the_executor_names_it():
    s = make_schedule("1f1b", 2, 3)
    t = simulate_ideal(s, 1, 2, t_comm=0.5)
    trace = t.to_trace()
    assert trace.source == "simulated" and trace.world_size == 2
    compute = [e for e in trace.events if e.stream == "compute"]
    assert len(compute) == 12 and all(e.kind == "compute" for e in compute)
    first = min((e for e in compute if e.rank == 1), key=lambda e: e.start_s)
    assert first.name == compute_name("F", 1, 0) == "F stage=1 mb=0"
    assert (first.start_s, first.dur_s) == (1.5, 1.0)  # F on stage 0, then the activation transfer
    sends = [e for e in trace.events if e.stream == "p2p"]
    assert len(sends) == 6 and {e.name.split()[1] for e in sends} == {"act", "grad"}
    assert trace.meta["step_time"] == t.step_time
    assert not [e for e in simulate_ideal(s, 1, 2).to_trace().events if e.stream == "p2p"]


# --- the factory ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (("pipedream", 4, 8), "unknown pipeline schedule 'pipedream' (expected one of gpipe, 1f1b, "),
    (("interleaved-1f1b", 4, 9, 2), "in max(1, m // pp) = 2 equal rounds, as PyTorch does, and 9 microbatches do "
                                    "not split into 2; 8 or 10 do"),
    (("interleaved-1f1b", 4, 8, 1), "needs virtual stages per rank >= 2, got 1"),
    (("1f1b", 4, 8, 2), "needs virtual stages per rank 1, got 2"),
    (("zbv", 4, 8, 3), "needs virtual stages per rank 2, got 3"),
    (("gpipe", 0, 8), "pipeline size must be at least 1, got 0"),
    (("gpipe", 4, 0), "number of microbatches must be at least 1, got 0"),
])
def test_make_schedule_rejects_impossible_requests_in_one_line(args, message):
    with pytest.raises(ParsimError) as err:
        make_schedule(*args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_make_schedule_defaults_to_each_schedules_own_virtual_stages():
    assert make_schedule("interleaved-1f1b", 4, 8).virtual_stages == 2
    assert make_schedule("zbv", 4, 8).virtual_stages == 2
    assert make_schedule("1F1B", 4, 8).virtual_stages == 1


def test_package_docstring_example_runs():
    assert doctest.testmod(parsim.schedules).failed == 0
