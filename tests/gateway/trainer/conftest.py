from tests.gateway.store_on_both import redis, redis_url

__all__ = ["redis", "redis_url"]
