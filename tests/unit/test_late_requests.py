"""A model's late requests (common/late_requests.py): stored with the model, carried on the wire, and
how long the frontend waits for one."""

from __future__ import annotations

import pytest

from common.late_requests import SERVE_LATE_LIMIT_S, LateRequests
from common.pb import control
from common.sample_models import mlp_small, model_bytes
from frontend.frontend_state import late_limit_s
from globalsched.rpc.convert import model_desc
from globalsched.state.database.migrate import TABLES
from globalsched.state.modeldb import ModelDatabase, ServingSettings

MODEL = model_bytes(mlp_small())


def test_the_setting_is_stored_kept_by_an_upload_without_it_and_changed_by_one_with_it(tmp_path):
    db = ModelDatabase(tmp_path)
    db.add_model("m", [MODEL])
    assert db.serving("m").late_requests is LateRequests.DROP                      # a new model drops
    db.add_model("m", [MODEL], late_requests=LateRequests.SERVE)
    db.add_model("m", [MODEL], serving=ServingSettings(expected_rate_rps=50.0))   # without it: kept
    assert db.serving("m") == ServingSettings(50.0, 0, LateRequests.SERVE)
    db.close()
    again = ModelDatabase(tmp_path)                                                 # durable
    assert again.serving("m").late_requests is LateRequests.SERVE
    again.add_model("m", [MODEL], late_requests=LateRequests.DROP)
    assert again.serving("m").late_requests is LateRequests.DROP
    assert "model_late_requests" in TABLES                                          # nexus db migrate copies it
    again.close()


def test_the_model_description_carries_it(tmp_path):
    db = ModelDatabase(tmp_path)
    record = db.add_model("m", [MODEL], late_requests=LateRequests.SERVE)
    desc = model_desc(record, {}, True, serving=db.serving("m"))
    assert desc.late_requests == control.LATE_REQUESTS_SERVE
    assert LateRequests.from_pb(desc.late_requests) is LateRequests.SERVE
    assert LateRequests.from_pb(control.LATE_REQUESTS_DEFAULT) is LateRequests.DROP   # a table from before it
    db.close()


@pytest.mark.parametrize("deadline_s, limit_s", [
    (None, SERVE_LATE_LIMIT_S),           # no gRPC deadline: the limit
    (2.0, 2.0),                           # its gRPC deadline
])
def test_a_late_request_waits_until_the_clients_grpc_deadline(deadline_s, limit_s):
    assert late_limit_s(deadline_s) == limit_s
