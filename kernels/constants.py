"""Constants shared by every kernel and by both engines."""

# Marks a padding entry in any index tensor: KV-cache slot mappings and GDN state indices alike.
PAD_SLOT_ID = -1
