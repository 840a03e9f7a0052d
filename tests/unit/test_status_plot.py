"""The `nexus status --plot` picture, drawn from status values (no cluster): its legend names the
models that can be seen and explains every symbol the picture uses."""

from __future__ import annotations

from nexus.status_model import ClusterStatus, DeviceStatus, QueryStatus, SessionStatus
from nexus.status_plot import status_figure, write_status_plot


def _session(name: str, model: str, latency_ms: float, duty_cycle_ms: float, batch: int = 4) -> SessionStatus:
    return SessionStatus(session=name, model=model, batch=batch, latency_ms=latency_ms,
                         share=latency_ms / duty_cycle_ms, device_rate_rps=batch * 1000 / duty_cycle_ms,
                         planned_rate_rps=10.0, measured_rate_rps=9.0, slo_ms=100.0, memory_mb=100.0)


def _status() -> ClusterStatus:
    busy = DeviceStatus("be-1", "emulated:t4", "t4", 16000.0, 40.0, (
        _session("resnet", "resnet", 20.0, 40.0),
        _session("traffic/detect", "detector", 10.0, 40.0),
        _session("idle_model", "idle_model", 0.0, 40.0, batch=1),      # 0% of the cycle: nothing to see
    ))
    spare = DeviceStatus("be-2", "emulated:t4", "t4", 16000.0, 0.0, ())
    query = QueryStatus(name="traffic", slo_ms=200.0, split="dp", budgets_ms={"detect": 60.0, "vehicle": 120.0},
                        gamma={"detect->vehicle": 1.5}, planned_rate_rps=5.0, devices=1, reason="",
                        stage_models={"detect": "detector", "vehicle": "vehicle_cls"},
                        paths=(("detect", "vehicle"),))
    return ClusterStatus(epoch=3, solver="squishy", plan_age_s=2.0, planned_devices=1, lower_bound=1, frontends=1,
                         devices=(busy, spare), queries=(query,))


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_the_legend_names_the_models_that_can_be_seen_and_explains_every_symbol():
    texts = _legend_texts(status_figure(_status()))
    assert {"resnet", "detector", "vehicle_cls"} <= set(texts)     # vehicle_cls: a query stage's budget bar
    assert "idle_model" not in texts
    explained = "\n".join(texts)
    assert "×N" in explained and "batch" in explained
    assert "γ" in explained and "fan-out" in explained
    assert "SLO" in explained and "query stage" in explained and "idle" in explained


def test_without_queries_the_legend_explains_only_what_is_drawn(tmp_path):
    st = _status()
    plain = ClusterStatus(st.epoch, st.solver, st.plan_age_s, st.planned_devices, st.lower_bound, st.frontends,
                          (st.devices[0],), ())
    texts = "\n".join(_legend_texts(status_figure(plain)))
    assert "γ" not in texts and "SLO" not in texts and "×N" in texts
    write_status_plot(plain, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
