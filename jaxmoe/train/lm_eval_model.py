"""jaxmoe as an lm-eval model (``lm_eval`` 0.4.13, the ``[lmeval]`` extra): ``--model jaxmoe
--model_args ckpt=ENDPOINT``.

Importing this module registers the model; ``python -m jaxmoe.train.lm_eval_model ARGS`` is lm-eval's
own command line with it registered (``--model jaxmoe --model_args ckpt=hf:DIR --tasks ...
--include_path DIR``). The checkpoint is read as ``jaxmoe generate`` reads it, with its
``tokenizer.json`` (required: lm-eval's requests are text). ``loglikelihood``: one fp32 forward
per request (padded to a length bucket; causal, so the padding after it changes nothing);
``generate_until``: greedy decoding with the KV cache (:class:`jaxmoe.model.decode.Decoder`) of
``max_gen_toks`` tokens, the text cut at the first stop sequence (lm-eval's own post-processing).
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from jaxmoe.errors import UserError
from jaxmoe.model.decode import Decoder, bucket
from jaxmoe.port.commands.convert import load_numpy_tree
from jaxmoe.port.commands.generate import decode_config, eos_ids, find_tokenizer
from jaxmoe.port.formats import open_source, parse_endpoint


@register_model("jaxmoe")
class JaxmoeLM(TemplateLM):
    """A jaxmoe checkpoint behind lm-eval's ``loglikelihood`` / ``generate_until`` (module doc)."""

    def __init__(self, ckpt: str, max_gen_toks: int = 256, **_ignored):
        super().__init__()
        import jax
        import jax.numpy as jnp

        from jaxmoe.model.transformer import apply_model

        ep = parse_endpoint(ckpt, "ckpt")
        with open_source(ep) as source:
            meta = source.meta_dir
        self.tok = find_tokenizer(meta)
        if self.tok is None:
            raise UserError(f"lm-eval model jaxmoe: {ckpt} has no tokenizer.json; lm-eval's requests are text")
        eos = sorted(eos_ids(meta)) or ([self.tok.eot_id] if self.tok.eot_id is not None else [])
        if not eos:
            raise UserError(f"lm-eval model jaxmoe: {ckpt} names no end-of-sequence id (config.json eos_token_id)")
        self._eot = eos[0]
        cfg, params, buffers = load_numpy_tree(ep)
        self.cfg = decode_config(cfg)
        self.params, self.buffers = jax.tree.map(jnp.asarray, (params, buffers))
        self.max_length, self.max_gen_toks = self.cfg.model.max_seq_len, int(max_gen_toks)
        self.logp = jax.jit(lambda p, b, t: jax.nn.log_softmax(apply_model(self.cfg, p, b, t)[0], axis=-1))
        self.decoder = Decoder(self.cfg)

    @property
    def eot_token_id(self) -> int:
        return self._eot

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return [int(i) for i in self.tok.encode(string)]

    def tok_decode(self, tokens, **kwargs) -> str:
        return self.tok.decode(list(tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = []
        for _key, context, continuation in requests:
            seq = (list(context) + list(continuation))[-(self.max_length + 1):]
            inp = seq[:-1]
            row = np.zeros((1, min(bucket(len(inp)), self.max_length)), np.int32)
            row[0, :len(inp)] = inp
            logp = np.asarray(self.logp(self.params, self.buffers, row))[0, len(inp) - len(continuation):len(inp)]
            cont = np.asarray(continuation)
            ll = float(np.take_along_axis(logp, cont[:, None], -1).sum())
            out.append((ll, bool((logp.argmax(-1) == cont).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for (string,) in [r.args for r in requests]:
            ids = self.tok_encode(string)
            if len(ids) + 1 > self.max_length:
                raise UserError(f"lm-eval model jaxmoe: a document of {len(ids)} tokens is longer than the "
                                f"context ({self.max_length}); rolling windows are not implemented")
            out.append(self._loglikelihood_tokens([(None, [self._eot], ids)])[0][0])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        eos = self.tok_decode([self._eot])
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            n = int(kw.pop("max_gen_toks"))
            ids = self.tok_encode(context)[-(self.max_length - n):]
            toks, _ = self.decoder.generate(self.params, self.buffers, [ids], n, greedy=True)
            out.append(postprocess_generated_text(generation=self.tok_decode(toks[0].tolist()), stop=until,
                                                  think_end_token=None))
        return out


if __name__ == "__main__":  # lm-eval's command line, with the jaxmoe model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


__all__ = ["JaxmoeLM"]
