"""Speculation itself: trees and envelopes, acceptance, sampling, the hop's domain types."""
