"""The failure detector (globalsched/state/failure_detector.py): silence counted only while the scheduler ran,
and a scheduler that finds most nodes silent at once suspects itself before evicting anyone."""

from globalsched.state.failure_detector import DetectorConfig, DetectorState, detect, paused_recently, silence_s

CONFIG = DetectorConfig(timeout_s=5.0, interval_s=1.0)


def run(seen_by_time, times, state=DetectorState()):
    verdict = None
    for now in times:
        verdict, state = detect(seen_by_time(now), state, now, CONFIG)
    return verdict, state


def test_a_node_silent_beyond_the_timeout_is_removed_and_the_others_stay():
    seen = lambda now: {"a": now - (now % 1.0), "b": now - (now % 1.0), "c": 2.0}  # noqa: E731
    verdict, _ = run(seen, [float(t) for t in range(1, 9)])
    assert [node for node, _ in verdict.removed] == ["c"]
    assert "missed heartbeats for 6.0 s" in verdict.removed[0][1]


def test_silence_within_the_timeout_removes_nobody():
    verdict, _ = run(lambda now: {"a": 1.0, "b": 1.0, "c": now}, [2.0, 3.0, 4.0, 5.0, 6.0])
    assert verdict.removed == ()


def test_a_stalled_scheduler_does_not_count_its_own_pause_against_the_nodes():
    # Checks every second up to 10 s, then nothing until 17 s (the scheduler was stalled for 6 s);
    # every node's heartbeats stopped reaching it at 10 s, so each has 7 s of wall-clock silence.
    state = DetectorState()
    for now in range(1, 11):
        _, state = detect({"a": float(now), "b": float(now), "c": float(now)}, state, float(now), CONFIG)
    verdict, state = detect({"a": 10.0, "b": 10.0, "c": 10.0}, state, 17.0, CONFIG)
    assert verdict.removed == ()
    assert state.pauses == ((11.0, 17.0),)
    assert silence_s(10.0, 17.0, state.pauses) == 1.0


def test_most_nodes_silent_at_once_make_the_scheduler_suspect_itself_for_a_while():
    seen = {f"n{i}": 0.0 for i in range(6)}
    state = DetectorState()
    for now in range(1, 12):                      # no pause: the checks came on time, the nodes went quiet
        verdict, state = detect(seen, state, float(now), CONFIG)
    assert verdict.removed == () and "6 of 6 nodes silent at once" in verdict.note
    removed_at = {}
    for now in range(12, 12 + int(CONFIG.self_suspicion_s)):
        verdict, state = detect(seen, state, float(now), CONFIG)
        removed_at.update({node: now for node, _ in verdict.removed})
        for node, _ in verdict.removed:
            del seen[node]                        # as the reaper removes them
    # a whole rack can fail too: once the suspicion has held its limit (from 6 s, when they fell silent), they go
    assert removed_at == {f"n{i}": 6 + int(CONFIG.self_suspicion_s) for i in range(6)}


def test_the_suspicion_ends_when_the_nodes_are_heard_again():
    state = DetectorState()
    for now in range(1, 8):
        _, state = detect({"a": 0.0, "b": 0.0}, state, float(now), CONFIG)
    assert state.suspect_since_s is not None
    verdict, state = detect({"a": 8.0, "b": 8.0}, state, 8.0, CONFIG)
    assert verdict == type(verdict)() and state.suspect_since_s is None


def test_one_silent_node_among_many_is_no_reason_for_suspicion():
    seen = lambda now: {"dead": 0.0, **{f"n{i}": now for i in range(5)}}  # noqa: E731
    verdict, _ = run(seen, [float(t) for t in range(1, 7)])
    assert [n for n, _ in verdict.removed] == ["dead"] and not verdict.note


def test_a_stream_that_ends_as_the_scheduler_resumes_is_left_to_the_heartbeats():
    # checks every second up to 10 s: no pause, a stream's end then is the node's
    _, state = run(lambda now: {"a": now}, [float(t) for t in range(1, 11)])
    assert not paused_recently(state, 10.2, CONFIG)
    # nothing since 10 s: at 20 s the scheduler finds itself overdue (a pause its next check has yet to record)
    assert paused_recently(state, 20.0, CONFIG)
    # that check records the pause (11-20 s), and keeps its end when the node, heard again at once, leaves no
    # silence for the pause to count against: a stream that ends within the timeout after it is no evidence...
    _, state = run(lambda now: {"a": 20.0}, [20.0], state)
    assert state.pauses == () and state.last_pause_end_s == 20.0
    assert paused_recently(state, 24.9, CONFIG)
    # ...and one that ends later is, once the checks ran on time since
    _, state = run(lambda now: {"a": now}, [21.0, 22.0, 23.0, 24.0, 25.0, 26.0], state)
    assert not paused_recently(state, 26.1, CONFIG)
