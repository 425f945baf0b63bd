"""Redis tier: payload frames and their publication records in Redis (one server or a
Redis Cluster), shared by every host that names the same index namespace."""

from kvlife.tiers.redis.connect import RedisEndpoint
from kvlife.tiers.redis.tier import RedisTier

__all__ = ["RedisEndpoint", "RedisTier"]
