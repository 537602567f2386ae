"""Generated wire contract (package pdparams.v1). Regenerate with scripts/gen_proto.py."""
from __future__ import annotations

from . import paramserver_pb2 as pb
from . import paramserver_pb2_grpc as pb_grpc

SERVICE_NAME = "pdparams.v1.ParamServer"

__all__ = ["pb", "pb_grpc", "SERVICE_NAME"]
