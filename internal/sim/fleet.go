package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
)

// FleetReport is the outcome of a mixed fleet: one run per model, played
// at once against one mesh (RunFleet).
type FleetReport struct {
	// Models are the runs' reports, in the order of the configs.
	Models []*Report `json:"models"`
	// OK is set when every run is OK and every run's stored keys are of
	// its own model.
	OK bool `json:"ok"`
}

// RunFleet plays every config at once, each a fleet of engines of its own
// model (Config.Model, its own engines and gpuworkers, its own run tag)
// against one mesh that serves all the models, and reports each run. Each
// run checks its engines byte for byte against its own model's layout, so
// a lookup of one model answered from another model's keys would show as
// mismatched or unverified blocks; no two configs may share a model or a
// run tag.
func RunFleet(ctx context.Context, cfgs []Config) (*FleetReport, error) {
	if len(cfgs) == 0 {
		return nil, fmt.Errorf("no model to play: %w", ErrConfig)
	}
	models, tags := map[string]bool{}, map[string]bool{}
	for i := range cfgs {
		if cfgs[i].Model == nil {
			return nil, fmt.Errorf("fleet config %d: no model: %w", i, ErrConfig)
		}
		if cfgs[i].RunTag == "" {
			cfgs[i].RunTag = NewRunTag()
		}
		if models[cfgs[i].Model.Name] || tags[cfgs[i].RunTag] {
			return nil, fmt.Errorf("fleet config %d: model %s or run tag %s played twice: %w", i, cfgs[i].Model.Name, cfgs[i].RunTag, ErrConfig)
		}
		models[cfgs[i].Model.Name], tags[cfgs[i].RunTag] = true, true
	}
	out := &FleetReport{Models: make([]*Report, len(cfgs))}
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, cfg := range cfgs {
		wg.Go(func() {
			rep, err := Run(ctx, cfg)
			if err != nil {
				err = fmt.Errorf("model %s: %w", cfg.Model.Name, err)
			}
			out.Models[i], errs[i] = rep, err
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return out, err
	}
	out.OK = true
	for _, rep := range out.Models {
		out.OK = out.OK && rep.OK
	}
	return out, nil
}

// WriteText writes the fleet's summary, one line per model (requests, hit
// rate, verified and mismatched blocks, the save ledger), then each
// model's own report.
func (f *FleetReport) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "model\tlayout\tengines\trequests\tok\tfailed\thit rate\tloaded tokens\tverified blocks\tmismatched\tledger\tstored keys checked\twrong\tresult")
	for _, r := range f.Models {
		if r == nil {
			continue
		}
		var checked, wrong int
		if r.Stored != nil {
			checked, wrong = r.Stored.Checked, r.Stored.Wrong
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%.1f%%\t%s\t%d\t%d\t%s (%d stored, %d existing, %d skipped)\t%d\t%d\t%s\n",
			r.Model, r.Layout, len(r.Engines), r.Requests.Total, r.Requests.OK, r.Requests.Failed, 100*r.PrefixHitRate,
			loadedText(r.Tokens.Loaded), r.Verification.VerifiedBlocks, r.Verification.Mismatched,
			balancedText(r.Ledger.Balanced), r.Ledger.Stored, r.Ledger.Existing, r.Ledger.Skipped, checked, wrong, okText(r.OK))
	}
	fmt.Fprintf(tw, "fleet\t\t\t\t\t\t\t\t\t\t\t\t\t%s\n", okText(f.OK))
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range f.Models {
		if r == nil {
			continue
		}
		if _, err := fmt.Fprintf(w, "\n%s\n", strings.Repeat("-", 8)+" model "+r.Model+" "+strings.Repeat("-", 8)); err != nil {
			return err
		}
		if err := r.WriteText(w); err != nil {
			return err
		}
	}
	return nil
}
