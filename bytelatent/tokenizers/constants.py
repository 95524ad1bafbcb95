"""Token ids shared by every byte-level component (they match the reference BLT)."""

BOE_ID = 0  # beginning of entity / padding id in packed batches
BOS_ID = 1
EOS_ID = 2
BPE_ID = 3  # BPE delimiter token
OFFSET = 4  # byte b is token b + OFFSET
PAD_ID = -1  # fill value for generation buffers only; never embedded
BYTE_UNITS = 256
VOCAB_SIZE = BYTE_UNITS + OFFSET  # 260
