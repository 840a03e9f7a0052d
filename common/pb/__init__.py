"""Generated protobuf/gRPC stubs (see protos/generate.py); the one import point for them.

``from common.pb import kserve, kserve_grpc, control, control_grpc``.
"""

from common.pb.inference import grpc_service_pb2 as kserve  # noqa: F401
from common.pb.inference import grpc_service_pb2_grpc as kserve_grpc  # noqa: F401
from common.pb.inference import model_config_pb2 as model_config  # noqa: F401
from common.pb.nexus import control_pb2 as control  # noqa: F401
from common.pb.nexus import control_pb2_grpc as control_grpc  # noqa: F401
