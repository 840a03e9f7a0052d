"""The private descriptor pool of this project's generated stubs (see protos/generate.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
