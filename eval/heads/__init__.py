"""Draft heads that read the target's features: the EAGLE head (eagle.py) and Medusa heads
(medusa.py), saved and read through io.py. Their proposers are in eval/proposers/."""

from .eagle import Block, EagleHead, HeadConfig
from .io import read_head, save_head
from .medusa import MedusaConfig, MedusaHeads, ResBlock, TokenBlock

__all__ = ["Block", "EagleHead", "HeadConfig", "MedusaConfig", "MedusaHeads", "ResBlock", "TokenBlock",
           "read_head", "save_head"]
