"""Draft heads that read the target's features: the EAGLE head (eagle.py), the EAGLE-3 head
(eagle3.py), the DFlash draft (dflash.py) and Medusa heads (medusa.py), saved and read through io.py. Their proposers are in
eval/proposers/."""

from .dflash import DFlashConfig, DFlashHead
from .eagle import Block, EagleHead, HeadConfig
from .eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from .io import read_head, save_head
from .medusa import MedusaConfig, MedusaHeads, ResBlock, TokenBlock

__all__ = ["Block", "DFlashConfig", "DFlashHead", "Eagle3Config", "Eagle3Head", "EagleHead", "HeadConfig", "MedusaConfig", "MedusaHeads", "ResBlock",
           "TokenBlock", "default_aux_layers", "read_head", "save_head"]
