"""What both sides of the seam share: the messages (protocol.py), their codec for Redis (codec.py) and
the fleet's Redis keys (fleet_keys.py)."""
