"""gRPC settings shared by every process: message limits and channel options."""

from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
UPLOAD_CHUNK_BYTES = 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def bind(server: grpc.aio.Server, address: str) -> str:
    """Bind ``address`` (port 0 picks a free port) and return the bound HOST:PORT."""
    host = address.rpartition(":")[0]
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return f"{host}:{port}"
