"""Incremental text from token ids: whole UTF-8 characters only, and stop strings held back until sure."""
from __future__ import annotations

from collections.abc import Sequence

from linnet.tokenizer import Tokenizer


class TextStream:
    """Feed token ids; get back the text that can safely be shown now.

    Text that could be the start of a stop string is held back until it either completes the stop
    string (then the stream ends, the stop string itself never shown) or cannot any more.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._decoder = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (up to a stop string)
        self._shown = 0
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        piece = self._decoder.step(self.tokenizer.hf, token) or ""
        self.text += piece
        for s in self.stop:
            # Only the new piece can complete a stop string; search from where it could start.
            at = self.text.find(s, max(0, len(self.text) - len(piece) - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text, once no more tokens will come.

        Bytes still waiting for the rest of their character never will: decode them as a whole decode
        would (as U+FFFD), so the streamed text always equals ``tokenizer.decode(ids)``.
        """
        if not self.stopped:
            self.text = self.tokenizer.decode(self.ids)
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        # Longest tail of the text that is a proper prefix of some stop string.
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._shown)
        out, self._shown = self.text[self._shown:upto], upto
        return out
