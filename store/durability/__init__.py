"""How writes become durable: group commit (fails closed), checkpoints, and the packer."""
