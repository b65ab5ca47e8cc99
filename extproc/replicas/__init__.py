"""Replicas that act as one router: `serve --workers N` and the Redis pub/sub that shares each
replica's picks with the others (docs/decisions/0210-replicas-share-picks-over-redis.md)."""
