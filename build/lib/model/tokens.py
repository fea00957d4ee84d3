"""Token ids every part of the project agrees on: 0 = padding and the decoder's start symbol,
1 = end of sentence, 2 = unknown. The tokenizer is trained with these ids (nmt/tokenizer.py)."""

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
