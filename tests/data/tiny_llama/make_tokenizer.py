"""Write the tiny word-level tokenizer the transformers tests ship (tests/data/tiny_llama/).

Run from the repository root with transformers and tokenizers installed:
    python tests/data/tiny_llama/make_tokenizer.py
"""
import os

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ("the a an and or of to in on at for with from by is are was were be been it this that these those "
         "model models weight weights quantized tensor tensors block blocks scale scales code codes byte bytes "
         "layer layers linear matrix vector value values run runs fast slow small large one two three four "
         "five six seven eight nine ten cpu gpu memory file files load save read write text token tokens "
         "hello world qcore llama . , ! ?").split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def main() -> None:
    vocab = {w: i for i, w in enumerate(SPECIALS + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
