"""Finding peers on the LAN: DNS-SD names and records, and the zeroconf layer."""
