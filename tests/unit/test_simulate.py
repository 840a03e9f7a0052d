"""``nexus simulate``: determinism, conservation, queueing arithmetic, faults, and that the simulator
runs the production decision code (changing a production rule changes the simulated result)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from common.config import SchedulerConfig
from common.runtimes.base import RuntimeKind
from common.warmup_spec import default_runs
from nexus.cli import main
from nexus.simulate.config import Fault, FaultKind, SimConfig
from nexus.simulate.devices import SimBackend
from nexus.simulate.models import linear_models, shares
from nexus.simulate.outcomes import Status
from nexus.simulate.report import dumps, summarize
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals, parse_schedule, scheduled_arrivals

MODELS = linear_models(4, 200.0, 8.0, 20.0, 32, memory_mb=500)
STEP = "0:60,20:300,40:60"


def run(models=MODELS, schedule=STEP, duration_s=60.0, seed=1, cv=1.0, arrivals=None, **config) -> tuple[Simulation, dict]:
    arrivals = arrivals or scheduled_arrivals(parse_schedule(schedule), shares(models), duration_s, cv=cv, seed=seed)
    sim = Simulation(models, arrivals, SimConfig(seed=seed, **config))
    sim.run()
    return sim, summarize(sim)


def evenly(model: str, rate_rps: float, duration_s: float, start_s: float = 0.0) -> Arrivals:
    times = np.arange(start_s, duration_s, 1.0 / rate_rps)
    return Arrivals(times, np.zeros(times.size, dtype=np.int32), (model,), duration_s)


# ---- determinism and conservation ----------------------------------------------------------------


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_bytes():
    first = dumps(run(seed=7)[1])
    assert dumps(run(seed=7)[1]) == first
    assert dumps(run(seed=8)[1]) != first


def test_every_request_ends_exactly_once_through_steps_scale_down_kills_and_a_stall():
    faults = (Fault(FaultKind.KILL_BACKENDS, 25.0, count=2), Fault(FaultKind.STALL_SCHEDULER, 30.0, duration_s=8.0))
    scheduler = SchedulerConfig(scale_down_cooldown_s=5.0, min_devices="t4=1", max_devices="t4=8")
    sim, result = run(max_backends=8, faults=faults, scheduler=scheduler)
    status = sim.outcomes.status
    assert not np.any(status == Status.PENDING)
    assert sim.outcomes.ended == status.size == result["requests"]
    assert sum(result["outcomes"].values()) == result["requests"]
    assert result["failed"] == sum(result["outcomes"][k] for k in ("dropped", "unavailable", "overloaded", "expired"))
    kinds = [e["text"] for e in sim.events if e["kind"] == "fault"]
    assert any("killed" in k for k in kinds) and any("stall" in k for k in kinds)
    assert any("drained and exited" in e["text"] for e in sim.events)       # it scaled down after the step


# ---- queueing arithmetic -------------------------------------------------------------------------


def test_an_underloaded_device_answers_everything_in_its_batch_time_plus_the_path():
    # l(1) = 8 + 20 = 28 ms; one request every 100 ms never waits: every latency is l(1) + the path.
    models = linear_models(1, 200.0, 8.0, 20.0, 32)
    # From 1 s on: the first plan is in place (coalescing, planning, the table's push and warm-up).
    sim, result = run(models, arrivals=evenly("m0000", 10.0, 30.0, start_s=1.0), backends=1, jitter_cv=0.0,
                      path_ms=1.0)
    assert result["within_slo"] == 1.0
    answered = sim.outcomes.latency_ms[sim.outcomes.status == Status.ON_TIME]
    assert answered.size == 290 and np.allclose(answered, 28.0 + 1.0)


def test_an_overloaded_device_serves_its_capacity_and_drops_the_rest():
    # Batches are capped at the saturated batch (2*l(b) <= 200 ms with l(b) = 8b + 20: b = 10, l(10) =
    # 100 ms), so one device serves at most 10/0.1 = 100 requests/s; at 200 offered, at most half.
    models = linear_models(1, 200.0, 8.0, 20.0, 32)
    _, result = run(models, arrivals=evenly("m0000", 200.0, 30.0), backends=1, jitter_cv=0.0)
    capacity = 10 / 0.100 / 200.0
    assert 0.9 * capacity <= result["within_slo"] <= capacity + 0.01
    assert result["outcomes"]["late"] == 0          # early drop: nothing runs that would be late


def test_killed_backends_lose_only_what_no_other_backend_could_take_and_the_plan_repairs():
    sim, result = run(schedule="0:120", duration_s=40.0, backends=4,
                      faults=(Fault(FaultKind.KILL_BACKENDS, 15.0, count=1),))
    removed = [e for e in sim.events if e["kind"] == "membership" and "Attach stream ended" in e["text"]]
    assert len(removed) == 1
    assert result["lost_to_faults"] <= 40            # at most the killed backend's queue and in-flight batch
    after = sim.arrivals.times_s > 16.0             # once the repaired plan is in force
    assert np.mean(sim.outcomes.status[after] == Status.ON_TIME) > 0.98


def test_a_new_sessions_warm_up_runs_on_the_device_before_its_table_takes_effect():
    """As backend/model_table.py's table update: load, then the engine's warm-up batches that hold the
    answer (the planned batch, here 1, as often as the emulated runtime's default warm-up runs it),
    then the table; the device's busy time counts them."""
    models = linear_models(1, 200.0, 8.0, 20.0, 32)     # l(1) = 28 ms; planned at batch 1 for 1 rps
    sim, result = run(models, arrivals=evenly("m0000", 1.0, 3.0, start_s=2.0), backends=1, jitter_cv=0.0,
                      path_ms=1.0)
    [backend] = sim.backends.values()
    assert result["outcomes"]["on_time"] == 1
    warm_s = default_runs(RuntimeKind.EMULATED) * 0.028      # the warm-up batches at b = 1
    assert backend.busy_s == pytest.approx(warm_s + 0.028)    # then the request
    slow, _ = run(models, arrivals=evenly("m0000", 1.0, 3.0, start_s=2.0), backends=1, jitter_cv=0.0,
                  table_update_ms=500.0)
    assert [b.busy_s for b in slow.backends.values()] == [pytest.approx(warm_s + 0.028)]
    # the first request waits for the first table: coalescing, planning, the table's fixed time, the
    # load, the warm-up, and the hops; a longer table update makes it wait longer
    patient = linear_models(1, 2000.0, 8.0, 20.0, 32)
    early = dataclasses.replace(evenly("m0000", 1.0, 1.0), duration_s=3.0)
    latency_ms = [run(patient, arrivals=early, backends=1, jitter_cv=0.0, path_ms=1.0, table_update_ms=ms)[0]
                  .outcomes.latency_ms[0] for ms in (100.0, 400.0)]
    assert latency_ms[0] > 100.0 + warm_s * 1000.0 + 28.0
    assert latency_ms[1] == pytest.approx(latency_ms[0] + 300.0, abs=1.0)


def test_a_backend_added_under_load_holds_its_answer_for_the_planned_batch_and_warms_batch_1_when_idle(
        monkeypatch):
    """backend/warmup_runner.py: the planned batch's warm-up holds the table's answer; batch 1's is
    deferred until the table took effect, and runs on an idle device."""
    models = linear_models(1, 200.0, 8.0, 20.0, 32)      # about 100 rps a device: 150 rps needs a second
    seen = []
    warm_one = SimBackend._warm_one

    def observed(self, now):
        seen.append((self.node_id, len(self.warmups), len(self.deferred_warmups), self.warming,
                     sum(len(s.queue) for s in self.sessions.values()), self.sessions.get("m0000")))
        warm_one(self, now)
    monkeypatch.setattr(SimBackend, "_warm_one", observed)
    # no device headroom: the backend is added for the plan's own sessions (a spare's may plan batch 1,
    # which leaves nothing to defer)
    sim, _ = run(models, arrivals=evenly("m0000", 150.0, 8.0, start_s=2.0), backends=None, max_backends=3,
                 jitter_cv=0.0, path_ms=1.0, scheduler=SchedulerConfig(device_headroom=0.0))
    added = [s for s in seen if s[0] != "be-0"]
    holding = [s for s in added if s[3]]                  # while the table waits for its warm-up
    deferred = [s for s in added if not s[3]]
    assert holding and deferred
    assert all(s[1] == 1 and s[2] == 1 and s[5] is None for s in holding)    # the planned batch; not serving yet
    assert all(s[1] == 0 and s[4] == 0 and s[5] is not None and s[5].planned_batch > 1 for s in deferred)


def test_a_request_that_waits_out_its_deadline_for_a_lost_route_is_unavailable():
    """frontend/frontend_state.py: with every backend of a model gone, a request waits for the repaired table
    and is UNAVAILABLE when none comes in time (DEADLINE_EXCEEDED only for the first table's hold)."""
    models = linear_models(1, 200.0, 8.0, 20.0, 32)
    _, result = run(models, arrivals=evenly("m0000", 50.0, 20.0, start_s=2.0), backends=1,
                    faults=(Fault(FaultKind.KILL_BACKENDS, 10.0, count=1),))
    assert result["outcomes"]["unavailable"] > 0 and result["outcomes"]["expired"] == 0


def _stalled_for(seconds: float) -> tuple[Simulation, dict]:
    return run(schedule="0:100", duration_s=40.0, backends=3,
               faults=(Fault(FaultKind.STALL_SCHEDULER, 10.0, duration_s=seconds),))


def _removed(sim: Simulation) -> list[str]:
    return [e["text"] for e in sim.events if e["kind"] == "membership" and " removed: " in e["text"]]


def test_a_stalled_scheduler_evicts_nobody():
    """Its nodes' heartbeats are lost while it stalls, and as it resumes its keepalive ends every
    node's Attach stream (the worst case of the race on real processes): the production rule leaves
    each end to the heartbeats, every node registers again, and nothing is removed."""
    sim, result = _stalled_for(8.0)
    assert not _removed(sim)
    ended = [e for e in sim.events if "Attach stream ended just after the scheduler was paused" in e["text"]]
    assert len(ended) == 4 and all(e["time_s"] == 18.0 for e in ended)     # 3 backends and the frontend
    again = [e for e in sim.events if e["text"].endswith(" registered") and e["time_s"] > 18.0]
    assert sorted(e["text"].split()[0] for e in again) == ["be-0", "be-1", "be-2", "fe-0"]
    seconds = result["per_second"]
    # past the cold start (the first second waits for the first tables), the stall costs nothing
    stalled = [w for t, w in zip(seconds["time_s"], seconds["within_slo"]) if t >= 2]
    assert min(stalled) >= 0.99, stalled


def test_a_stall_within_the_keepalive_timeout_ends_no_stream():
    sim, _ = _stalled_for(1.5)
    assert not [e for e in sim.events if "Attach stream" in e["text"]] and not _removed(sim)


def test_without_the_pause_rule_the_streams_ended_at_resume_evict_the_cluster(monkeypatch):
    """What real processes found (tests/e2e/test_scheduler_stall.py): without
    globalsched/state/failure_detector.py's ``paused_recently``, a stream that ends as the scheduler
    resumes removes its node. The simulator finds it too."""
    import nexus.simulate.control as control

    monkeypatch.setattr(control, "paused_recently", lambda *a, **k: False)
    sim, _ = _stalled_for(8.0)
    removed = _removed(sim)
    assert len(removed) == 4 and all(r.endswith("its Attach stream ended") for r in removed), removed


# ---- the production code decides -----------------------------------------------------------------


def test_changing_the_production_scaling_policy_changes_the_simulated_devices(monkeypatch):
    import globalsched.planning.scaling_policy as policy

    _, before = run(max_backends=8)
    decide = policy._decide

    def never_more_than_one(d, history, config, now_s):
        decision, history = decide(d, history, config, now_s)
        return dataclasses.replace(decision, desired=1), history
    monkeypatch.setattr(policy, "_decide", never_more_than_one)
    _, after = run(max_backends=8)
    assert max(before["per_second"]["backends"]) > 1 and max(after["per_second"]["backends"]) == 1


def test_a_step_across_many_models_starts_its_devices_from_the_first_reports_after_it(monkeypatch):
    """40 models, 100 -> 300 requests/s at 20 s: each model's 2 s report is within its own noise, and
    the plan followed the windows' means, a device or a few per re-plan (16 devices by 33 s). Summed,
    the first reports after the step are far beyond noise, and the scaler asks for the step's devices
    at once; with the rule off (the ratio always 1) it does not."""
    import globalsched.actuators.device_scaler as scaler

    models = linear_models(40, 200.0, 8.0, 20.0, 32, memory_mb=500)

    def step(**config):
        sim, result = run(models=models, schedule="0:100,20:300,60:100", max_backends=20, **config)
        first = next(e for e in sim.events if e["kind"] == "scaling" and e["time_s"] >= 20.0)
        return first, result["per_second"]["backends"]
    first, backends = step()
    assert first["time_s"] < 21.5 and "the latest reports are x" in first["text"] and first["desired"] >= 16
    assert backends[23] >= 16
    ratios = scaler.report_ratios
    monkeypatch.setattr(scaler, "report_ratios", lambda planned, measured: (1.0, ratios(planned, measured)[1]))
    first, backends = step()
    assert "the latest reports" not in first["text"] and max(backends[:30]) < 16


def test_changing_the_production_batching_policy_changes_the_simulated_outcomes(monkeypatch):
    from common.batch_decision import Selection, SlidingWindowEarlyDrop

    _, before = run()
    monkeypatch.setattr(SlidingWindowEarlyDrop, "_select", lambda self, queue, now, b, l: Selection(dropped=tuple(queue)))
    _, after = run()
    assert before["within_slo"] > 0.9 and after["within_slo"] == 0.0


def test_changing_the_production_planner_changes_the_simulated_plans(monkeypatch):
    import globalsched.planning.planner as planner

    _, before = run(backends=4)
    plan_type = planner.plan_type
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["now_s"])
        return plan_type(*args, **kwargs)
    monkeypatch.setattr(planner, "plan_type", counting)
    _, after = run(backends=4)
    assert calls and dumps(after) == dumps(before)     # the very function the scheduler plans with


KILLED_AT_S = 13.0


def _failed_after_kill(seed: int) -> tuple[int, Simulation]:
    """Requests not on time from just before one of 8 backends is killed at 13 s, models that take 2 s to
    load (the make step after the kill is long), spare GPUs of one batch each: pooled ones (the
    default) hold a spare of most sessions of the killed backend elsewhere, and the replacements'
    routes then matter little. The kill meets the make step of the plan that the first surges force
    (about 10.5 s), which runs until about 15 s. Every device keeps burst room (Z = 1.5), as on a
    cluster of fixed size whose idle devices are too few for the spares: the rules below measured
    so. With these 8 backends' room for spares instead (Z = 0, the default here), the repair that
    supersedes failed 123 requests over seeds 1-10 against 229 waiting, but more than waiting at
    seeds 1-3 (64 against 34; benchmarks/elastic.md)."""
    models = linear_models(16, 200.0, 8.0, 20.0, 32, memory_mb=500)
    sim, _ = run(models, schedule="0:200", duration_s=30.0, backends=8, model_load_s=2.0, seed=seed,
                 faults=(Fault(FaultKind.KILL_BACKENDS, KILLED_AT_S, count=1),),
                 scheduler=SchedulerConfig(spare_overbook=1.0, burst_sigma=1.5))
    after = sim.arrivals.times_s > KILLED_AT_S - 0.1
    return int(np.sum(sim.outcomes.status[after] != Status.ON_TIME)), sim


def test_sessions_go_live_on_their_new_backends_before_the_slowest_backend_answers(monkeypatch):
    """globalsched/actuators/early_routes.py as the distribution drives it: after a kill, the replicas
    that replace the lost ones take load as soon as they are warm, not when the last of the plan's
    backends has loaded its models; without it (the production rule changed) more requests fail
    (seeds 1-3: 50 failed with it, 84 without)."""
    import globalsched.actuators.early_routes as early_routes

    def failed_after_kill():
        failed, live = 0, []
        for seed in (1, 2, 3):
            n, sim = _failed_after_kill(seed)
            failed += n
            live += [e for e in sim.events if e["kind"] == "routes" and e["time_s"] > KILLED_AT_S]
        return failed, live

    failed, live = failed_after_kill()
    assert live and all(e["sessions"] > 0 for e in live)
    monkeypatch.setattr(early_routes.EarlyRoutes, "due", lambda self: frozenset())
    failed_without, live_without = failed_after_kill()
    assert not live_without and failed < failed_without


def test_the_repair_after_a_kill_supersedes_the_make_step_under_way(monkeypatch):
    """globalsched/planning/control_loop.py's may_supersede, as the simulated scheduler plans: the
    repair plan goes out at once, not when the make step under way has warmed its last session; with
    the production rule changed to wait, more requests fail (seeds 1-3: 50 failed, 109 waiting)."""
    import nexus.simulate.control as control

    failed, sims = zip(*(_failed_after_kill(seed) for seed in (1, 2, 3)))
    superseding = [e for sim in sims for e in sim.events if e["kind"] == "plan" and "supersedes" in e["text"]]
    assert superseding
    monkeypatch.setattr(control, "may_supersede", lambda make_step_s, forced: False)
    waiting, sims = zip(*(_failed_after_kill(seed) for seed in (1, 2, 3)))
    assert not [e for sim in sims for e in sim.events if e["kind"] == "plan" and "supersedes" in e["text"]]
    assert sum(failed) < sum(waiting)


# ---- the command ---------------------------------------------------------------------------------


def write_models(tmp_path, models=None) -> str:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(models or {
        "a": {"slo_ms": 200, "share": 0.5, "profile": [{"batch": b, "latency_ms": 20 + 8 * b, "memory_mb": 500}
                                                        for b in range(1, 17)]},
        "b": {"slo_ms": 100, "share": 0.5, "profile": [{"batch": b, "latency_ms": 5 + 2 * b, "memory_mb": 300}
                                                        for b in range(1, 17)]}}))
    return str(path)


def test_the_command_writes_the_contracted_json_and_a_plot(tmp_path, capsys):
    models = write_models(tmp_path)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["simulate", "--models", models, "--device-type", "t4", "--backends", "auto", "--max-backends", "6",
            "--arrivals", "gamma", "--cv", "2", "--schedule", "0:50,20:250,40:50", "--duration-s", "60",
            "--seed", "3", "--scale-down-cooldown-s", "10", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("requests", "within_slo", "failed", "device_seconds", "lower_bound_device_seconds"):
        assert key in result
    assert 0 <= result["within_slo"] <= 1 and result["lower_bound_device_seconds"] > 0
    assert [r["at_s"] for r in result["recovery"]] == [20.0, 40.0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    first = out.read_bytes()
    assert main(argv) == 0 and out.read_bytes() == first
    assert "within SLO" in capsys.readouterr().out


def test_the_command_answers_how_many_devices_a_workload_needs(tmp_path, capsys):
    models = write_models(tmp_path)
    out = tmp_path / "size.json"
    assert main(["simulate", "--models", models, "--schedule", "0:300", "--duration-s", "20", "--size-for", "0.99",
                 "--max-backends", "3", "--json", str(out)]) == 0
    answer = json.loads(out.read_text())
    trials = {t["devices"]: t["within_slo"] for t in answer["trials"]}
    n = answer["devices"]
    assert trials[n] >= 0.99 and (n - 1 not in trials or trials[n - 1] < 0.99)
    assert f"{n} devices keep" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "0:10", "--trace", "x.csv"], "--trace gives the arrivals"),
    ([], "give the arrivals"),
    (["--schedule", "5:10"], "schedule"),
    (["--schedule", "0:10", "--fault", "kill:5"], "expected KIND:SECONDS:AMOUNT"),
    (["--schedule", "0:10", "--fault", "melt:5:1"], "unknown kind 'melt'"),
    (["--schedule", "0:10", "--cv", "3"], "--cv applies to --arrivals gamma"),
    (["--schedule", "0:10", "--max-backends", "0"], "--max-backends 0 is below --min-backends 1"),
    (["--schedule", "0:10", "--size-for", "1.5"], "--size-for must be a fraction"),
])
def test_bad_input_is_refused_with_a_precise_error(tmp_path, capsys, argv, message):
    models = write_models(tmp_path)
    assert main(["simulate", "--models", models, "--duration-s", "5", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_bad_models_file_and_a_trace_of_unknown_models_are_refused(tmp_path, capsys):
    bad = write_models(tmp_path, {"a": {"slo_ms": 100, "share": 1, "profile": [{"batch": 1, "latency_ms": 5}],
                                        "colour": "red"}})
    assert main(["simulate", "--models", bad, "--schedule", "0:10"]) == 2
    assert "model 'a': unknown key(s) ['colour']" in capsys.readouterr().err
    trace = tmp_path / "t.csv"
    trace.write_text("time_s,model\n0.5,a\n1.0,zebra\n")
    assert main(["simulate", "--models", write_models(tmp_path), "--trace", str(trace)]) == 2
    assert "zebra" in capsys.readouterr().err


def test_a_model_repository_is_simulated_with_its_slos_rates_and_datasheet_profiles(tmp_path, capsys):
    from common.sample_models import mlp_small, model_bytes

    def model(name: str, params: str) -> None:
        d = tmp_path / "repo" / name / "1"
        d.mkdir(parents=True)
        (d / "model.onnx").write_bytes(model_bytes(mlp_small()))
        (d.parent / "config.pbtxt").write_text(f'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n{params}')

    model("fast", 'parameters { key: "slo_ms" value { string_value: "40" } }\n'
                  'parameters { key: "expected_rate_rps" value { string_value: "300" } }')
    model("slow", 'parameters { key: "expected_rate_rps" value { string_value: "100" } }')
    out = tmp_path / "out.json"
    assert main(["simulate", "--model-repository", str(tmp_path / "repo"), "--device-type", "t4",
                 "--schedule", "0:400", "--duration-s", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    counts = {name: m["requests"] for name, m in result["per_model"].items()}
    assert 2.5 < counts["fast"] / counts["slow"] < 3.5          # shares from the expected rates
    assert result["within_slo"] > 0.95
    (tmp_path / "repo" / "other" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "other" / "1" / "model.onnx").write_bytes(b"not onnx")
    assert main(["simulate", "--model-repository", str(tmp_path / "repo"), "--schedule", "0:10"]) == 2
    assert "other" in capsys.readouterr().err
    assert main(["simulate", "--schedule", "0:10"]) == 2
    assert "give the models one way: --models MODELS.json, --model-repository DIR or --model-database" \
        in capsys.readouterr().err


def test_a_schedulers_model_database_is_simulated_with_what_it_serves(tmp_path, capsys):
    """--model-database reads a scheduler's --data-dir read-only: loaded models only, with their SLOs,
    replicas, expected rates, batch caps and profiles (table, else the emulated datasheet)."""
    from common.profile import Profile
    from common.sample_models import mlp_small, model_bytes
    from globalsched.state.modeldb import ModelDatabase, ServingSettings

    db = ModelDatabase(tmp_path / "data")
    table = Profile.linear(2.0, 5.0, 16, device_type="t4")
    db.add_model("tabled", [model_bytes(mlp_small())], profile_json=table.to_json(), slo_ms=80, min_replicas=2,
                 serving=ServingSettings(expected_rate_rps=300.0, batch_cap=4))
    db.add_model("sheet", [model_bytes(mlp_small())], slo_ms=120, serving=ServingSettings(expected_rate_rps=100.0))
    db.add_model("stored", [model_bytes(mlp_small())], create_session=False)      # uploaded, not loaded
    db.close()
    before = (tmp_path / "data" / "nexus.db").read_bytes()
    from nexus.simulate.models import database_models

    models = {m.name: m for m in database_models(tmp_path / "data", "t4")}
    assert sorted(models) == ["sheet", "tabled"]
    tabled = models["tabled"]
    assert (tabled.slo_ms, tabled.min_replicas, tabled.expected_rate_rps, tabled.share) == (80.0, 2, 300.0, 300.0)
    assert tabled.profile.max_batch == 4 and tabled.profile.latency_ms(2) == table.latency_ms(2)
    assert models["sheet"].profile.max_batch > 0 and models["sheet"].slo_ms == 120.0
    out = tmp_path / "out.json"
    assert main(["simulate", "--model-database", str(tmp_path / "data"), "--device-type", "t4",
                 "--schedule", "0:200", "--duration-s", "10", "--json", str(out)]) == 0
    counts = {name: m["requests"] for name, m in json.loads(out.read_text())["per_model"].items()}
    assert 2.5 < counts["tabled"] / counts["sheet"] < 3.5
    assert (tmp_path / "data" / "nexus.db").read_bytes() == before         # nothing written there
    assert main(["simulate", "--model-database", str(tmp_path / "none"), "--schedule", "0:10"]) == 2
    assert "no model database here" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    import sqlite3

    with sqlite3.connect(tmp_path / "data" / "nexus.db") as newer:       # a later release's database
        newer.execute("PRAGMA user_version = 999")
    assert main(["simulate", "--model-database", str(tmp_path / "data"), "--schedule", "0:10"]) == 2
    assert "has schema 999; this release reads" in capsys.readouterr().err


def test_measured_device_time_runs_a_batch_for_the_rows_measured_mean_not_the_conservative_figure():
    from common.profile import BatchLatency, Profile
    from nexus.simulate.config import DeviceTime
    from nexus.simulate.models import SimModel

    profile = Profile(tuple(BatchLatency(b, 30.0 + 10 * b, 100.0, mean_ms=15.0 + 5 * b, std_ms=0.0) for b in range(1, 9)))
    models = (SimModel("m", 300.0, 1.0, profile),)
    latencies = {}
    for mode in DeviceTime:
        sim, _ = run(models, arrivals=evenly("m", 5.0, 20.0), backends=1, path_ms=1.0, device_time=mode)
        latencies[mode] = sim.outcomes.latency_ms[sim.outcomes.status == Status.ON_TIME][10:]
    assert np.allclose(latencies[DeviceTime.MEASURED], 20.0 + 1.0)       # mean_ms at batch 1, no spread
    assert np.all(latencies[DeviceTime.PROFILE] > 30.0)                   # l(1) = 40 ms, jittered


def _backend_alone(tables: list[tuple[str, int]]) -> tuple[list[float], list[list[str]], set[str]]:
    """A backend outside any cluster, sent ``tables`` (one model each, with its epoch) at once; its
    answers, the tables it applied, and the sessions it holds at the end."""
    import heapq

    from nexus.simulate.devices import SimBackend

    models = linear_models(3, 200.0, 8.0, 20.0, 32)
    sim = Simulation(models, evenly("m0000", 1.0, 2.0), SimConfig(backends=1, seed=1))
    backend = SimBackend(sim, "be-x", 0.0)
    answers: list[float] = []
    applied: list[list[str]] = []
    apply_table = backend.apply_table
    backend.apply_table = lambda now, entries, cold=frozenset(): (applied.append(sorted(entries)),
                                                                  apply_table(now, entries, cold))
    for model, epoch in tables:
        backend.update_table(0.0, {model: (1, 200.0, models[0].profile)}, answers.append, epoch=epoch)
    while sim._heap:                                 # only the backend's events are queued
        t, _, fn, args = heapq.heappop(sim._heap)
        sim.now = t
        fn(t, *args)
    return answers, applied, set(backend.sessions)


def test_a_tables_warm_ups_run_while_its_next_models_load_as_the_backend_runs_them():
    """backend/model_table.py: each new session's warm-up starts once its model is loaded, while the
    next loads; the answer comes after the loads and the last warm-up, not after every warm-up."""
    import heapq

    from nexus.simulate.devices import SimBackend

    models = linear_models(3, 200.0, 8.0, 20.0, 32)        # l(8) = 84 ms, shorter than a load
    sim = Simulation(models, evenly("m0000", 1.0, 2.0), SimConfig(backends=1, seed=1, jitter_cv=0.0,
                                                                   model_load_s=0.1, table_update_ms=200.0))
    backend = SimBackend(sim, "be-x", 0.0)
    answers: list[float] = []
    backend.update_table(0.0, {m.name: (8, 200.0, m.profile) for m in models}, answers.append, epoch=1)
    while sim._heap:                                 # only the backend's events are queued
        t, _, fn, args = heapq.heappop(sim._heap)
        sim.now = t
        fn(t, *args)
    runs = default_runs(RuntimeKind.EMULATED)
    assert set(backend.sessions) == {m.name for m in models}
    assert backend.busy_s == pytest.approx(3 * runs * (0.084 + 0.028))      # and batch 1's, deferred
    assert answers == [pytest.approx(0.2 + 3 * 0.1 + runs * 0.084)]      # in turn: 0.2 + 0.3 + 3 * 0.084


def test_a_release_older_than_the_table_in_place_is_ignored_as_the_backend_ignores_it():
    """The release step of a plan comes after its routing tables and a delay; by then a newer plan's
    table may be in place, and the backend must not apply the older one over it."""
    answers, applied, sessions = _backend_alone([("m0000", 5), ("m0001", 4)])       # the second is stale
    assert len(answers) == 2 and applied == [["m0000"]] and sessions == {"m0000"}


def test_a_table_queued_behind_a_newer_one_is_answered_without_effect_as_the_backend_answers_it():
    # a release (11) still queued when the next plan's table (12) comes: superseded
    answers, applied, sessions = _backend_alone([("m0000", 10), ("m0001", 11), ("m0002", 12)])
    assert len(answers) == 3 and applied == [["m0000"], ["m0002"]] and sessions == {"m0002"}
