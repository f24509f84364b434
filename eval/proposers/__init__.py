"""Draft proposers for the speculative decoder (eval/decoder.py).

  base.py      the interface (`Proposer`, its optional abilities declared), `Sampling`, `NoDraft`, and
               the helpers proposers share
  ngram.py     prompt lookup                      draft_lm.py  a small causal LM (HF, self-spec, int8)
  eagle.py     an EAGLE head over the features    medusa.py    Medusa heads over the features
  eagle3.py    an EAGLE-3 head over three target layers
  dflash.py    a DFlash draft: a block of drafts in one forward over fused target layers
  hybrid.py    lookups and a model as one token tree per round
  loader.py    load_proposer (a draft directory, module or name -> its proposer), serve_with

A new proposer subclasses `Proposer`, declares the abilities it has, and is returned by the `load`
function of the draft kind it serves (eval/draft_dir.py DraftKind), which load_proposer calls.
"""

from ..draft_dir import SERVE_KEYS, SERVED_AS
from .base import NoDraft, Proposer, Sampling, check_sampling, draw, to_target_vocab, verified_input
from .dflash import DFlashProposer
from .draft_lm import DraftLMProposer
from .eagle import EagleProposer
from .eagle3 import Eagle3Proposer
from .hybrid import HybridProposer
from .loader import load_proposer, serve_with
from .medusa import MedusaProposer
from .ngram import NgramProposer

__all__ = ["SERVE_KEYS", "SERVED_AS", "DFlashProposer", "DraftLMProposer", "Eagle3Proposer", "EagleProposer", "HybridProposer",
           "MedusaProposer", "NgramProposer", "NoDraft", "Proposer", "Sampling", "check_sampling", "draw",
           "load_proposer", "serve_with", "to_target_vocab", "verified_input"]
